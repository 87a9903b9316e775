"""Anthropic's Messages API passed through to backends that serve it (`llamacpp`, `anthropic`): a recording
upstream proves that the bytes it receives are the client's, that the stream comes back as it was sent, and
that a fallback to an OpenAI-shaped backend translates."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from tests.support.gateway import RunningGateway, gateway_thread
from tests.support.llamacpp import gateway_metric, wait_for
from tests.support.upstream import Ok, ScriptedUpstream, Status

# Written by hand, as a client may: spacing, key order and cache_control breakpoints that a re-serialisation
# would change (orjson writes neither the spaces nor the escaped slash).
BODY = (
    b'{ "model" : "native",  "max_tokens": 16,\n'
    b'  "system": [{"type": "text", "text": "Be brief.\\/", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],\n'
    b'  "messages": [{"role": "user", "content": [{"type": "text", "text": "Say ok", '
    b'"cache_control": {"type": "ephemeral"}}]}], "metadata": {"user_id": "u1"} }'
)


@pytest.fixture()
def native() -> Iterator[tuple[ScriptedUpstream, RunningGateway]]:
    with ScriptedUpstream(default=Ok(tokens=3)) as up, ScriptedUpstream() as claude:
        config = f"""
backends:
  llama: {{type: llamacpp, base_url: "{up.url}/v1", api_key: llama-secret}}
  claude: {{type: anthropic, base_url: "{claude.url}/v1", api_key: anthropic-secret}}
  sim: {{type: simulated, ttft_ms: 5, tpot_ms: 1, tokens: 4}}
models:
  native: {{backend: llama, fallback: [translated]}}
  renamed: {{backend: llama, upstream_model: tiny-q4}}
  sonnet: {{backend: claude, upstream_model: claude-sonnet-4-5}}
  translated: {{backend: sim}}
"""
        with gateway_thread(config) as gw:
            gw.claude = claude  # type: ignore[attr-defined]
            yield up, gw


def test_the_body_reaches_a_native_backend_byte_for_byte(native: tuple[ScriptedUpstream, RunningGateway]) -> None:
    up, gw = native
    headers = {"x-api-key": "client-key", "anthropic-version": "2023-06-01", "anthropic-beta": "tools-2024"}
    answer = httpx.post(f"{gw.url}/v1/messages?beta=true", content=BODY, headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["content"][0]["text"] == "tok0 tok1 tok2"
    assert answer.headers["x-sluice-model"] == "native"
    sent = up.requests[-1]
    assert sent.path == "/v1/messages"
    assert sent.body == BODY
    assert sent.headers["anthropic-version"] == "2023-06-01"
    assert sent.headers["anthropic-beta"] == "tools-2024"
    assert sent.headers["authorization"] == "Bearer llama-secret"  # the backend's key, never the client's
    assert "x-api-key" not in sent.headers


def test_only_the_model_is_rewritten(native: tuple[ScriptedUpstream, RunningGateway]) -> None:
    up, gw = native
    body = BODY.replace(b'"native"', b'"renamed"')
    assert httpx.post(f"{gw.url}/v1/messages", content=body, timeout=30).status_code == 200
    assert up.requests[-1].body == BODY.replace(b'"native"', b'"tiny-q4"')


def test_a_stream_is_relayed_as_the_backend_sent_it(native: tuple[ScriptedUpstream, RunningGateway]) -> None:
    up, gw = native
    body = BODY.replace(b'"max_tokens": 16', b'"max_tokens": 16, "stream": true')
    through = httpx.post(f"{gw.url}/v1/messages", content=body, timeout=30)
    direct = httpx.post(f"{up.url}/v1/messages", content=body, timeout=30)
    assert through.headers["content-type"].startswith("text/event-stream")
    assert through.content == direct.content
    assert up.requests[-2].body == body
    client: Any = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)
    with client.messages.stream(model="native", max_tokens=16, messages=[{"role": "user", "content": "hi"}]) as s:
        message = s.get_final_message()
    assert message.content[0].text == "tok0 tok1 tok2"
    # The prompt's usage came in message_start, the output's alone in message_delta: the two are one account.
    assert message.usage.input_tokens == 21
    assert message.usage.output_tokens == 3


def test_count_tokens_is_asked_of_the_backend(native: tuple[ScriptedUpstream, RunningGateway]) -> None:
    up, gw = native
    client: Any = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)
    counted = client.messages.count_tokens(model="native", messages=[{"role": "user", "content": "one two three"}])
    assert counted.input_tokens == 10
    assert up.requests[-1].path == "/v1/messages/count_tokens"


def test_fallback_to_an_openai_shaped_backend_translates(native: tuple[ScriptedUpstream, RunningGateway]) -> None:
    up, gw = native
    up.script(Status(503, {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}))
    client: Any = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)
    raw = client.messages.with_raw_response.create(
        model="native", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
    )
    assert raw.headers["x-sluice-model"] == "translated"
    assert raw.headers["x-sluice-fallback"] == "error"
    message = raw.parse()
    assert len(message.content[0].text.split()) == 4
    assert message.usage.output_tokens == 4


def test_anthropic_backend(native: tuple[ScriptedUpstream, RunningGateway]) -> None:
    _, gw = native
    claude: ScriptedUpstream = gw.claude  # type: ignore[attr-defined]
    client: Any = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)
    message = client.messages.create(model="sonnet", max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    assert message.content[0].type == "text"
    sent = claude.requests[-1]
    assert sent.path == "/v1/messages"
    assert sent.headers["x-api-key"] == "anthropic-secret"
    assert "authorization" not in sent.headers
    assert json.loads(sent.body)["model"] == "claude-sonnet-4-5"
    # The client's anthropic-version goes as it sent it; without one, the backend's configured version.
    plain = {"model": "sonnet", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    given = {"anthropic-version": "2099-01-01"}
    assert httpx.post(f"{gw.url}/v1/messages", json=plain, headers=given, timeout=30).status_code == 200
    assert claude.requests[-1].headers["anthropic-version"] == "2099-01-01"
    assert httpx.post(f"{gw.url}/v1/messages", json=plain, timeout=30).status_code == 200
    assert claude.requests[-1].headers["anthropic-version"] == "2023-06-01"
    # An OpenAI-shaped request for a model on Anthropic's API is told where to go, not forwarded.
    chat = {"model": "sonnet", "messages": [{"role": "user", "content": "hi"}]}
    refused = httpx.post(f"{gw.url}/v1/chat/completions", json=chat, timeout=30)
    assert refused.status_code == 400
    assert re.search("POST /v1/messages", refused.json()["error"]["message"])


def test_a_native_backends_error_keeps_its_shape(native: tuple[ScriptedUpstream, RunningGateway]) -> None:
    up, gw = native
    error = {"type": "error", "error": {"type": "invalid_request_error", "message": "prompt is too long"}}
    up.script(Status(400, error))
    answer = httpx.post(f"{gw.url}/v1/messages", content=BODY, timeout=30)
    assert answer.status_code == 400
    assert answer.json() == error


def test_the_providers_prompt_cache_share_is_counted(native: tuple[ScriptedUpstream, RunningGateway]) -> None:
    """sluice_tokens_total{direction="cache_read"} against direction="input": what Grafana shows as the share."""
    _, gw = native

    def count(direction: str) -> float:
        return gateway_metric(gw.url, "sluice_tokens_total", model="native", direction=direction)

    before_read, before_input = count("cache_read"), count("input")
    assert httpx.post(f"{gw.url}/v1/messages", content=BODY, timeout=30).status_code == 200
    # The recording upstream reports 21 input tokens not cached and 7 read from its cache: 28 in all.
    wait_for(lambda: count("cache_read") == before_read + 7, what="cache_read counted")
    assert count("input") == before_input + 28
