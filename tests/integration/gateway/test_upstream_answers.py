"""What an upstream answers that the client must not get as is: bodies that are not JSON, refused credentials,
and the details of an error that the client does need (Azure's content-filter results)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.gateway import RunningGateway, gateway_thread
from tests.support.upstream import Ok, ScriptedUpstream, Status

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


@pytest.fixture()
def primary() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream(default=Ok(tokens=3)) as up:
        yield up


@pytest.fixture()
def spare() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream(default=Ok(tokens=3, text="from the spare")) as up:
        yield up


@pytest.fixture()
def gateway(primary: ScriptedUpstream, spare: ScriptedUpstream) -> Iterator[RunningGateway]:
    config = f"""
backends:
  main: {{type: openai, base_url: "{primary.url}/v1", api_key: sk-backend-secret}}
  other: {{type: openai, base_url: "{spare.url}/v1", api_key: sk-other-secret}}
pool: {{warm_connections: 1}}
models:
  chat: {{backend: main, fallback: [spare]}}
  alone: {{backend: main}}
  spare: {{backend: other}}
cache: {{mode: always}}
plugins: [cache]
"""
    with gateway_thread(config) as gw:
        yield gw


def post(gw: RunningGateway, model: str, content: str = "hello") -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}]}
    return httpx.post(f"{gw.base_url}/chat/completions", json=body, headers={"authorization": "Bearer sk-client"})


@pytest.mark.parametrize("body", [b"<html><body>502 Bad Gateway</body></html>", b'{"id": "cut sh', b"", b"  \n"])
def test_a_200_that_is_not_json_fails_over_and_is_never_cached(
    gateway: RunningGateway, primary: ScriptedUpstream, spare: ScriptedUpstream, body: bytes
) -> None:
    primary.script(Status(200, body))
    served = post(gateway, "chat", "over")
    assert served.status_code == 200
    assert served.headers["x-sluice-model"] == "spare"
    assert served.headers["x-sluice-fallback"] == "error"

    primary.script(Status(200, body))
    alone = post(gateway, "alone", "not cached")
    assert alone.status_code == 502
    assert alone.json()["error"]["code"] == "upstream_invalid_body"
    again = post(gateway, "alone", "not cached")  # the bad answer was not stored: this one goes upstream
    assert again.status_code == 200
    assert again.headers["x-sluice-cache"] == "miss"
    assert again.json()["choices"][0]["message"]["content"]


def test_json_with_leading_whitespace_is_accepted(gateway: RunningGateway, primary: ScriptedUpstream) -> None:
    whole = b'\n  {"id":"x","object":"chat.completion","created":0,"model":"m","choices":[]}\r\n'
    primary.script(Status(200, whole))
    response = post(gateway, "alone", "spaced")
    assert response.status_code == 200
    assert response.content == whole


@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_backend_key_is_a_502_not_the_clients_fault(
    gateway: RunningGateway, primary: ScriptedUpstream, status: int
) -> None:
    refusal = {"error": {"message": "Incorrect API key provided: sk-backe***cret", "type": "invalid_request_error"}}
    primary.script(Status(status, refusal))
    response = post(gateway, "alone", f"refused {status}")
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "upstream_auth_failed"
    assert "'main'" in error["message"]
    assert "sk-" not in response.text
    primary.script(Status(status, refusal))
    assert post(gateway, "chat", f"over {status}").headers["x-sluice-model"] == "spare"  # another backend may serve


def test_azure_content_filter_details_reach_the_client(gateway: RunningGateway, primary: ScriptedUpstream) -> None:
    inner = {
        "code": "ResponsibleAIPolicyViolation",
        "content_filter_result": {"hate": {"filtered": True, "severity": "high"}},
    }
    filtered: dict[str, dict[str, Any]] = {
        "error": {"message": "filtered", "type": None, "param": "prompt", "code": "content_filter"}
    }
    filtered["error"]["innererror"] = inner
    primary.script(Status(400, filtered))
    client = openai.OpenAI(base_url=gateway.base_url, api_key="sk-client", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="alone", messages=[{"role": "user", "content": "filtered"}])
    assert caught.value.code == "content_filter"
    assert caught.value.body["innererror"] == inner  # type: ignore[index]
