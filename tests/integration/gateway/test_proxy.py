"""The core request path against real upstreams on loopback: credentials, providers, streaming, faults."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.gateway import RunningGateway, gateway_thread
from tests.support.upstream import (
    Buffered,
    MalformedChunk,
    MissingDone,
    Ok,
    ResetBeforeHeaders,
    ResetMidStream,
    ScriptedUpstream,
    Stall,
    Status,
)

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


@pytest.fixture()
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream(default=Ok(ttft_ms=5, tokens=5)) as up:
        yield up


def openai_config(up: ScriptedUpstream, timeouts: str = "") -> str:
    return f"""
backends:
  oa: {{type: openai, base_url: "{up.url}/v1", api_key: sk-backend-secret {timeouts}}}
pool: {{warm_connections: 2}}
models:
  gpt: {{backend: oa, upstream_model: gpt-4o-mini}}
  same: {{backend: oa}}
"""


@pytest.fixture()
def gateway(upstream: ScriptedUpstream) -> Iterator[RunningGateway]:
    with gateway_thread(openai_config(upstream)) as gw:
        yield gw


def client(gw: RunningGateway, **kw: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key="sk-client-key", max_retries=0, **kw)  # type: ignore[arg-type]


def test_credentials_model_mapping_and_headers(gateway: RunningGateway, upstream: ScriptedUpstream) -> None:
    raw = client(gateway).chat.completions.with_raw_response.create(
        model="gpt", messages=MESSAGES, extra_headers={"x-request-id": "req-123", "openai-organization": "org-x"}
    )
    answer = raw.parse()
    assert answer.choices[0].message.content
    seen = upstream.requests[-1]
    assert seen.path == "/v1/chat/completions"
    assert seen.headers["authorization"] == "Bearer sk-backend-secret"  # the backend's key, not the client's
    assert "sk-client-key" not in str(seen.headers)
    assert "openai-organization" not in seen.headers
    assert seen.json["model"] == "gpt-4o-mini"
    assert seen.json["messages"] == MESSAGES
    assert seen.headers["x-request-id"] == "req-123"
    headers = raw.headers
    assert headers["x-request-id"] == "req-123"
    assert headers["x-sluice-model"] == "gpt"
    assert float(headers["x-sluice-overhead-ms"]) >= 0
    stages = [part.split(";")[0] for part in headers["server-timing"].split(", ")]
    assert stages == ["parse", "pool", "upstream", "overhead"]
    assert "sk-backend-secret" not in raw.http_response.text
    assert "sk-backend-secret" not in str(headers)


def test_body_forwarded_byte_for_byte_when_nothing_changes(gateway: RunningGateway, upstream: ScriptedUpstream) -> None:
    body = b'{"model":"same", "messages":[{"role":"user","content":"x"}],  "vendor_extra":{"k":[1,2]}}'
    response = httpx.post(f"{gateway.base_url}/chat/completions", content=body)
    assert response.status_code == 200
    assert upstream.requests[-1].body == body


def test_connections_are_warm_and_reused(gateway: RunningGateway, upstream: ScriptedUpstream) -> None:
    assert upstream.connections_opened == 2  # opened at start-up, before any request
    for _ in range(20):
        client(gateway).chat.completions.create(model="gpt", messages=MESSAGES)
    assert upstream.connections_opened == 2
    assert {r.connection for r in upstream.requests} <= {1, 2}


def test_sdk_streams_sync_and_async(gateway: RunningGateway) -> None:
    chunks = list(
        client(gateway).chat.completions.create(
            model="gpt", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    async def run() -> str:
        async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="k", max_retries=0) as aclient:
            stream = await aclient.chat.completions.create(model="gpt", messages=MESSAGES, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    assert asyncio.run(run())
    completion = client(gateway).completions.create(model="gpt", prompt="hi")
    assert completion.choices[0].text
    assert client(gateway).embeddings.create(model="gpt", input="hi").data


def token_arrivals(url: str, model: str) -> list[float]:
    """Seconds from sending to each content chunk's arrival, for one streamed request."""
    started = time.perf_counter()
    arrivals = []
    body = {"model": model, "messages": MESSAGES, "stream": True}
    with httpx.stream("POST", f"{url}/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                arrivals.append(time.perf_counter() - started)
    return arrivals


def test_streaming_is_unbuffered(upstream: ScriptedUpstream) -> None:
    upstream.default = Ok(ttft_ms=100, tpot_ms=50, tokens=10)
    with gateway_thread(openai_config(upstream)) as gw:
        token_arrivals(gw.base_url, "gpt")  # warm
        # Side by side, best of three, so that a busy machine does not decide the outcome.
        direct = min((token_arrivals(f"{upstream.url}/v1", "gpt") for _ in range(3)), key=lambda a: a[0])
        through = min((token_arrivals(gw.base_url, "gpt") for _ in range(3)), key=lambda a: a[0])
        with httpx.stream(
            "POST", f"{gw.base_url}/chat/completions", json={"model": "gpt", "messages": MESSAGES, "stream": True}
        ) as response:
            assert response.headers["cache-control"] == "no-cache"
            assert response.headers["x-accel-buffering"] == "no"
    assert len(through) == 10
    # The first token as the upstream sent it: a buffering proxy would hold it until the end (~0.55 s); the
    # margin is for a loaded machine, the overhead itself is a fraction of a millisecond (sluice bench).
    assert 0.095 <= through[0] < direct[0] + 0.08
    assert through[0] < 0.3 < through[-1]  # well before the upstream's last token (~0.55 s)
    gaps = sorted(b - a for a, b in itertools.pairwise(through))
    assert gaps[len(gaps) // 2] > 0.035  # tokens arrive spaced as sent (50 ms), not in one burst


def test_azure_backend_paths_and_key() -> None:
    with ScriptedUpstream() as up:
        config = f"""
backends:
  az: {{type: azure, base_url: "{up.url}", api_key: azure-secret, api_version: "2024-10-21"}}
  az1: {{type: azure, base_url: "{up.url}", api_key: azure-secret, api_version: v1}}
models:
  chat: {{backend: az, upstream_model: my-deployment}}
  chat1: {{backend: az1, upstream_model: my-deployment}}
"""
        with gateway_thread(config) as gw:
            azure = openai.AzureOpenAI(azure_endpoint=gw.url, api_version="2024-10-21", api_key="client", max_retries=0)
            assert azure.chat.completions.create(model="chat", messages=MESSAGES).choices
            seen = up.requests[-1]
            assert seen.path == "/openai/deployments/my-deployment/chat/completions"
            assert seen.query == {"api-version": "2024-10-21"}
            assert seen.headers["api-key"] == "azure-secret"
            assert "authorization" not in seen.headers
            list(client(gw).chat.completions.create(model="chat1", messages=MESSAGES, stream=True))
            seen = up.requests[-1]
            assert seen.path == "/openai/v1/chat/completions"
            assert seen.json["model"] == "my-deployment"


def test_azure_preamble_does_not_count_as_first_token() -> None:
    with (
        ScriptedUpstream(default=Ok(ttft_ms=50, tokens=3, azure_preamble=True)) as up,
        gateway_thread(openai_config(up)) as gw,
    ):
        chunks = list(client(gw).chat.completions.create(model="gpt", messages=MESSAGES, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_vllm_backend_without_key() -> None:
    with ScriptedUpstream() as up:
        config = f"""
backends:
  v: {{type: vllm, base_url: "{up.url}/v1"}}
models:
  llama: {{backend: v, upstream_model: meta-llama/Llama-3.1-8B-Instruct}}
"""
        with gateway_thread(config) as gw:
            assert client(gw).chat.completions.create(model="llama", messages=MESSAGES).choices
            seen = [r for r in up.requests if r.method == "POST"][-1]  # GET /health is polled beside it
            assert "authorization" not in seen.headers
            assert seen.json["model"] == "meta-llama/Llama-3.1-8B-Instruct"


def test_upstream_errors_keep_their_status_in_openai_format(
    gateway: RunningGateway, upstream: ScriptedUpstream
) -> None:
    upstream.script(
        Status(
            429,
            {"error": {"message": "slow down", "type": "requests", "code": "rate_limit_exceeded"}},
            headers={"retry-after": "7"},
        )
    )
    response = httpx.post(f"{gateway.base_url}/chat/completions", json={"model": "gpt", "messages": MESSAGES})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "7"
    # The status, type and code as the upstream said them; its words are about the gateway's account, not the
    # client's (tests/integration/gateway/test_forwarded.py): a generic message instead.
    assert response.json() == {
        "error": {
            "message": "model 'gpt': the upstream is rate limiting the gateway; please try again shortly",
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    upstream.script(Status(500, b"<html>oops</html>"))
    response = httpx.post(f"{gateway.base_url}/chat/completions", json={"model": "gpt", "messages": MESSAGES})
    assert response.status_code == 500
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    upstream.script(Status(400, {"error": {"message": "bad", "type": "invalid_request_error", "code": 400}}))
    with pytest.raises(openai.BadRequestError):  # vLLM's integer code is accepted too
        client(gateway).chat.completions.create(model="gpt", messages=MESSAGES)


def test_transport_failures_map_to_502_and_504(upstream: ScriptedUpstream) -> None:
    with gateway_thread(openai_config(upstream, ", timeouts: {first_byte_s: 0.3}")) as gw:
        # Twice: a reset on a reused keep-alive connection before any byte is retried once on a fresh one.
        upstream.script(ResetBeforeHeaders(), ResetBeforeHeaders())
        with pytest.raises(openai.InternalServerError) as caught:
            client(gw).chat.completions.create(model="gpt", messages=MESSAGES)
        assert caught.value.status_code == 502
        upstream.script(Stall())
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as caught:
            client(gw).chat.completions.create(model="gpt", messages=MESSAGES)
        assert caught.value.status_code == 504
        assert time.monotonic() - started < 1.5
        assert upstream.wait_disconnect(2.0)
        assert client(gw).chat.completions.create(model="gpt", messages=MESSAGES).choices  # still serving


def test_no_upstream_at_all_is_502() -> None:
    config = """
backends:
  oa: {type: openai, base_url: "http://127.0.0.1:9/v1"}
models: {gpt: {backend: oa}}
pool: {warm_connections: 0}
"""
    with gateway_thread(config) as gw:
        response = httpx.post(f"{gw.base_url}/chat/completions", json={"model": "gpt", "messages": MESSAGES})
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "connect_error"


@pytest.mark.parametrize("fault", [ResetMidStream(after_chunks=3), MissingDone(tokens=3), MalformedChunk()])
def test_broken_streams_end_with_an_error_event(
    gateway: RunningGateway, upstream: ScriptedUpstream, fault: object
) -> None:
    upstream.script(fault)  # type: ignore[arg-type]
    with pytest.raises(openai.APIError):
        list(client(gateway).chat.completions.create(model="gpt", messages=MESSAGES, stream=True))
    body = {"model": "gpt", "messages": MESSAGES, "stream": True}
    upstream.script(fault)  # type: ignore[arg-type]
    lines = [line for line in httpx.post(f"{gateway.base_url}/chat/completions", json=body).text.splitlines() if line]
    assert lines[-1] == "data: [DONE]"
    assert lines[-2].startswith('data: {"error":')
    assert client(gateway).chat.completions.create(model="gpt", messages=MESSAGES).choices  # the gateway is fine


def test_client_disconnect_closes_the_upstream(gateway: RunningGateway, upstream: ScriptedUpstream) -> None:
    upstream.script(Ok(ttft_ms=50, tpot_ms=200, tokens=50))
    body = {"model": "gpt", "messages": MESSAGES, "stream": True}
    with httpx.stream("POST", f"{gateway.base_url}/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if "content" in line:
                break
    closed_at = time.monotonic()
    assert upstream.wait_disconnect(2.0)
    assert upstream.disconnects[0] - closed_at < 2.0  # not left to run its ~10 s of tokens
    upstream.script(Stall())  # a client that gives up while waiting for the first byte
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway.base_url}/chat/completions", json=body, timeout=0.3)
    assert upstream.wait_disconnect(2.0, count=2)


def test_buffering_upstream_is_passed_through_as_it_comes(gateway: RunningGateway, upstream: ScriptedUpstream) -> None:
    upstream.script(Buffered(tokens=4, tpot_ms=20))
    chunks = list(client(gateway).chat.completions.create(model="gpt", messages=MESSAGES, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
