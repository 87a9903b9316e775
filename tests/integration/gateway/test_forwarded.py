"""What goes upstream is what the gateway decided on (a rebuilt trace context, bodies without repeated deciding
fields), and what comes back of an upstream's failure is generic (the log keeps the detail). The stand-in
upstream records every request exactly as it received it."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import pytest

from tests.support.gateway import RunningGateway, free_port, gateway_thread
from tests.support.upstream import Ok, ResetMidStream, ScriptedUpstream, Status

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream(default=Ok(tokens=2)) as up:
        yield up


@pytest.fixture(scope="module")
def gateway(upstream: ScriptedUpstream) -> Iterator[RunningGateway]:
    config = f"""
backends:
  oa: {{type: openai, base_url: "{upstream.url}/v1", api_key: sk-backend}}
models:
  chat: {{backend: oa, upstream_model: small}}
  other: {{backend: oa, upstream_model: large}}
"""
    with gateway_thread(config) as gw:
        yield gw


def post(gw: RunningGateway, body: bytes, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{gw.base_url}/chat/completions", content=body, headers={"content-type": "application/json", **headers}
    )


def sent_traceparent(upstream: ScriptedUpstream) -> str | None:
    return upstream.requests[-1].headers.get("traceparent")


CHAT = b'{"model":"chat","messages":[{"role":"user","content":"hi"}]}'


def test_a_later_version_goes_upstream_as_the_four_fields_of_version_00(
    gateway: RunningGateway, upstream: ScriptedUpstream
) -> None:
    suffix = "-" + "a" * 8192  # a version after 00 may append fields: of any length
    response = post(gateway, CHAT, traceparent=f"01-{TRACE}-{PARENT}-01{suffix}")
    assert response.status_code == 200, response.text
    assert sent_traceparent(upstream) == f"00-{TRACE}-{PARENT}-01"
    response = post(gateway, CHAT, traceparent=f"02-{TRACE}-{PARENT}-00-future-fields")
    assert response.status_code == 200
    assert sent_traceparent(upstream) == f"00-{TRACE}-{PARENT}-00"  # the flags as parsed, the version ours


@pytest.mark.parametrize(
    "value",
    [
        f"00-{TRACE}-{PARENT}-01-extra",  # version 00 has exactly four fields
        f"ff-{TRACE}-{PARENT}-01",  # version ff is invalid
        f"01-{TRACE}-{PARENT}-01x",  # a later version's fields are still separated by a dash
        f"00-{'0' * 32}-{PARENT}-01",
        f"00-{TRACE.upper()}-{PARENT}-01",
        "garbage",
    ],
)
def test_an_invalid_traceparent_is_not_passed_on(
    gateway: RunningGateway, upstream: ScriptedUpstream, value: str
) -> None:
    assert post(gateway, CHAT, traceparent=value).status_code == 200
    assert sent_traceparent(upstream) is None  # tracing is off: the upstream starts the trace


def test_two_traceparent_headers_are_not_passed_on(gateway: RunningGateway, upstream: ScriptedUpstream) -> None:
    headers = [
        ("content-type", "application/json"),
        ("traceparent", f"00-{TRACE}-{PARENT}-01"),
        ("traceparent", f"00-{TRACE}-{'1' * 16}-01"),
    ]
    assert httpx.post(f"{gateway.base_url}/chat/completions", content=CHAT, headers=headers).status_code == 200
    assert sent_traceparent(upstream) is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model":"chat","messages":[{"role":"user","content":"hi"}],"model":"other"}', "model"),
        (b'{"model" : "other", "messages": [{"role": "user", "content": "hi"}], "model":\n"chat"}', "model"),
        (b'{"model":"chat","stream":false,"messages":[{"role":"user","content":"hi"}],"stream":true}', "stream"),
        (b'{"model":"chat","n":1,"n":50,"messages":[{"role":"user","content":"hi"}]}', "n"),
        (
            b'{"model":"chat","max_tokens":1,"messages":[{"role":"user","content":"hi"}],"max_tokens":9999}',
            "max_tokens",
        ),
        (
            b'{"model":"chat","temperature":0,"temperature":1,"messages":[{"role":"user","content":"hi"}]}',
            "temperature",
        ),
    ],
)
def test_a_repeated_deciding_field_is_refused_before_anything_goes_upstream(
    gateway: RunningGateway, upstream: ScriptedUpstream, body: bytes, param: str
) -> None:
    before = len(upstream.requests)
    response = post(gateway, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert param in error["message"]
    assert len(upstream.requests) == before


def test_the_same_names_nested_or_as_values_are_not_repeats(
    gateway: RunningGateway, upstream: ScriptedUpstream
) -> None:
    # "model" as a role, as a tool's property and in metadata, "n" twice in a nested object: none is top-level.
    body = (
        b'{"model":"chat","messages":[{"role":"model","content":"\\"model\\": x"},{"role":"user","content":"hi"}],'
        b'"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object",'
        b'"properties":{"model":{"type":"string"},"n":{"type":"integer"}}}}}],'
        b'"metadata":{"n":"1","stream":"x"},"stream":false}'
    )
    response = post(gateway, body)
    assert response.status_code == 200, response.text
    sent = upstream.requests[-1].json
    assert sent["model"] == "small"
    assert sent["metadata"] == {"n": "1", "stream": "x"}
    assert set(sent["tools"][0]["function"]["parameters"]["properties"]) == {"model", "n"}


# -- what a client is told of an upstream's failure ------------------------------------------------------------

SECRET_BODY = b"FATAL: connection to postgres://app:hunter2@db.internal:5432/llm failed; worker 10.1.2.3:9000"


def test_an_upstream_5xx_body_never_reaches_the_client(
    gateway: RunningGateway, upstream: ScriptedUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sluice.upstream")
    upstream.script(Status(503, SECRET_BODY))
    response = post(gateway, CHAT)
    assert response.status_code == 503
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] == "model 'chat': the upstream failed (status 503)"
    assert error["type"] == "upstream_error"
    for leak in (b"postgres", b"hunter2", b"db.internal", b"10.1.2.3", b"FATAL"):
        assert leak not in response.content
    assert any("FATAL: connection to postgres" in r.getMessage() for r in caplog.records)  # the log keeps it


def test_an_upstream_429_about_the_gateways_account_is_generic(
    gateway: RunningGateway, upstream: ScriptedUpstream
) -> None:
    quota = {
        "error": {
            "message": "Rate limit reached for gpt-4o in organization org-Zq7dKx19aQ2mWv on tokens per min (TPM): "
            "Limit 30000, Used 29000, Requested 2000.",
            "type": "tokens",
            "code": "rate_limit_exceeded",
        }
    }
    upstream.script(Status(429, quota, headers={"retry-after": "7"}))
    response = post(gateway, CHAT)
    assert response.status_code == 429
    error = response.json()["error"]
    assert "org-" not in response.text
    assert "30000" not in response.text
    assert error["code"] == "rate_limit_exceeded"
    assert response.headers["retry-after"] == "7"  # the client's SDK still backs off as advised


def test_an_upstream_400_about_the_clients_field_keeps_its_message_without_identifiers(
    gateway: RunningGateway, upstream: ScriptedUpstream
) -> None:
    invalid = {
        "error": {
            "message": "Invalid value for 'temperature': must be at most 2 (org-Zq7dKx19aQ2mWv, proj_AbCdEf123456; "
            "see https://docs.internal.example:8443/limits, key sk-proj-abc***xyz).",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": "invalid_value",
        }
    }
    upstream.script(Status(400, invalid))
    response = post(gateway, CHAT)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"].startswith("Invalid value for 'temperature': must be at most 2")
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "temperature", "invalid_value")
    for leak in ("org-", "proj_", "docs.internal", "8443", "sk-"):
        assert leak not in error["message"]


def test_a_stream_cut_mid_way_says_so_without_the_upstreams_address(
    gateway: RunningGateway, upstream: ScriptedUpstream
) -> None:
    upstream.script(ResetMidStream(after_chunks=2))
    body = b'{"model":"chat","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    response = post(gateway, body)
    assert response.status_code == 200
    assert "upstream stream failed: the upstream connection was cut" in response.text
    assert "127.0.0.1" not in response.text
    assert str(upstream.port) not in response.text
    assert response.text.rstrip().endswith("data: [DONE]")


def test_an_unreachable_upstream_is_named_by_the_model_not_its_address(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()  # nothing listens there
    config = f"""
backends:
  gone: {{type: openai, base_url: "http://127.0.0.1:{port}/v1", api_key: sk-backend}}
pool: {{warm_connections: 0}}
models:
  chat: {{backend: gone}}
"""
    caplog.set_level(logging.INFO, logger="sluice.upstream")
    with gateway_thread(config) as gw:
        response = post(gw, CHAT)
    assert response.status_code == 502
    error = response.json()["error"]
    assert error == {
        "message": "model 'chat': the upstream could not be reached",
        "type": "upstream_error",
        "param": None,
        "code": "connect_error",
    }
    assert str(port) not in response.text
    assert any(str(port) in r.getMessage() for r in caplog.records)  # the log says where
