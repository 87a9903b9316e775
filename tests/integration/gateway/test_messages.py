"""Anthropic's Messages API through the gateway, with the official `anthropic` SDK as the client.

Translated: the simulated backend and a scripted OpenAI-shaped upstream (tool calls both ways, what it is
sent). Every stage on the route: auth by `x-api-key` and by bearer, rate limits, the exact cache, fallback, the
telemetry headers, errors in Anthropic's shape with the statuses the SDK acts on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import orjson
import pytest

from gateway.app import create_app
from gateway.config import parse
from plugins.auth.keys import new_key
from tests.support.gateway import RunningGateway, gateway_thread
from tests.support.upstream import Raw, ScriptedUpstream, Status

SIM = """
backends:
  sim: {type: simulated, ttft_ms: 5, tpot_ms: 1, tokens: 8}
models:
  chat-large: {backend: sim, upstream_model: large, fallback: [chat-small]}
  chat-small: {backend: sim, upstream_model: small}
"""
KEY, HASH = new_key()


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningGateway]:
    with gateway_thread(SIM) as gw:
        yield gw


def client(gw: RunningGateway, key: str = "unused", **options: Any) -> Any:
    """The SDK's client, untyped: requests here name the gateway's models and its own errors' cases."""
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, **options)


def test_whole_answer_with_a_cached_system_prompt(sim: RunningGateway) -> None:
    system = [{"type": "text", "text": "You answer briefly. " * 50, "cache_control": {"type": "ephemeral"}}]
    raw = client(sim).messages.with_raw_response.create(
        model="chat-large", max_tokens=64, system=system, messages=[{"role": "user", "content": "Say ok"}]
    )
    message = raw.parse()
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.model == "chat-large"
    assert message.stop_reason == "end_turn"
    assert message.content[0].type == "text"
    assert len(message.content[0].text.split()) == 8
    assert message.usage.output_tokens == 8
    assert message.usage.input_tokens > 100  # the system prompt went upstream
    headers = raw.headers
    assert headers["x-sluice-model"] == "chat-large"
    assert "upstream;dur=" in headers["server-timing"]
    assert "parse;dur=" in headers["server-timing"]
    assert float(headers["x-sluice-overhead-ms"]) >= 0
    assert headers["x-request-id"]


def test_stream_has_anthropics_events_and_usage(sim: RunningGateway) -> None:
    with client(sim).messages.stream(
        model="chat-large", max_tokens=5, messages=[{"role": "user", "content": "Count to five"}]
    ) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert kinds[0] == "message_start"
    assert kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in kinds
    assert "content_block_stop" in kinds
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 5
    assert message.usage.input_tokens > 0
    assert len(message.content[0].text.split()) == 5


def test_stream_on_the_wire_has_usage_in_message_start_and_a_ping(sim: RunningGateway) -> None:
    body = {"model": "chat-large", "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    answer = httpx.post(f"{sim.url}/v1/messages?beta=true", json=body, timeout=30)
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[5:]) for line in answer.text.splitlines() if line.startswith("data:")]
    names = [line[7:] for line in answer.text.splitlines() if line.startswith("event: ")]
    assert names == [event["type"] for event in events]
    assert events[0]["type"] == "message_start"
    assert events[1]["type"] == "ping"
    assert isinstance(events[0]["message"]["usage"]["input_tokens"], int)
    assert events[-2]["usage"]["output_tokens"] == 3


def test_the_bare_request_of_the_instruction_count(sim: RunningGateway) -> None:
    """The Messages request `sluice bench --scenario instructions` sends (a bare POST, no SDK headers), whole and
    streamed: on the compiled build (tests/integration/gateway/test_builds.py runs this module there) a door that
    handed the pipeline an object of another class than its signature names failed every such request."""
    messages = [{"role": "user", "content": "Say ok"}]
    for stream in (False, True):
        body = orjson.dumps({"model": "chat-large", "max_tokens": 5, "stream": stream, "messages": messages})
        answer = httpx.post(
            f"{sim.url}/v1/messages", content=body, headers={"content-type": "application/json"}, timeout=30
        )
        assert answer.status_code == 200, answer.text
        assert (b'"text_delta"' if stream else b'"type":"text"') in answer.content


def test_count_tokens(sim: RunningGateway) -> None:
    counted = client(sim).messages.count_tokens(
        model="chat-large", messages=[{"role": "user", "content": "How many tokens is this?"}]
    )
    assert counted.input_tokens > 0


def test_errors_in_anthropics_shape(sim: RunningGateway) -> None:
    sdk = client(sim)
    with pytest.raises(anthropic.NotFoundError) as missing:
        sdk.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert missing.value.response.headers["x-should-retry"] == "false"  # asking again cannot help
    assert missing.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "model: nope (not a model of this gateway)"},
    }
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERg=="}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        sdk.messages.create(model="chat-large", max_tokens=5, messages=[{"role": "user", "content": [pdf]}])
    error: Any = refused.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error"
    assert "PDFs cannot" in error["message"]
    no_limit = httpx.post(f"{sim.url}/v1/messages", json={"model": "chat-large", "messages": []}, timeout=10)
    assert no_limit.status_code == 400
    assert no_limit.json()["error"]["type"] == "invalid_request_error"
    not_json = httpx.post(f"{sim.url}/v1/messages", content=b"{", timeout=10)
    assert not_json.status_code == 400
    assert not_json.json()["type"] == "error"
    assert httpx.get(f"{sim.url}/v1/messages", timeout=10).status_code == 405


def test_claude_codes_other_calls(sim: RunningGateway) -> None:
    """Claude Code checks its base URL with HEAD /api/hello; the SDK lists models at /v1/models."""
    assert httpx.head(f"{sim.url}/api/hello", timeout=10).status_code == 200
    names = [model.id for model in client(sim).models.list()]
    assert names == ["chat-large", "chat-small"]


TOOL_CALL = {
    "id": "chatcmpl-tool1",
    "object": "chat.completion",
    "created": 0,
    "model": "gpt",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {
        "prompt_tokens": 40,
        "completion_tokens": 9,
        "total_tokens": 49,
        "prompt_tokens_details": {"cached_tokens": 32},
    },
}


def http_answer(body: bytes, content_type: str = "application/json") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        content_type.encode(),
        len(body),
        body,
    )


def chunk(payload: dict[str, object]) -> str:
    return "data: " + json.dumps(payload) + "\n\n"


def streamed_tool_call() -> bytes:
    head = {"id": "chatcmpl-tool2", "object": "chat.completion.chunk", "created": 0, "model": "gpt"}
    call = {"index": 0, "id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    events = [
        chunk({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Checking."}}]}),
        chunk({**head, "choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}),
        chunk(
            {
                **head,
                "choices": [
                    {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]}}
                ],
            }
        ),
        chunk(
            {
                **head,
                "choices": [
                    {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ': "Oslo"}'}}]}}
                ],
            }
        ),
        chunk({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
        chunk({**head, "choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 12, "total_tokens": 62}}),
        "data: [DONE]\n\n",
    ]
    return http_answer("".join(events).encode(), "text/event-stream")


TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "cache_control": {"type": "ephemeral"},
    }
]


@pytest.fixture()
def scripted() -> Iterator[tuple[ScriptedUpstream, RunningGateway]]:
    with ScriptedUpstream() as up:
        config = f"""
backends:
  up: {{type: openai, base_url: "{up.url}/v1", api_key: upstream-secret}}
  sim: {{type: simulated, ttft_ms: 5, tpot_ms: 1, tokens: 4}}
models:
  gpt: {{backend: up, upstream_model: gpt-up, fallback: [backup]}}
  backup: {{backend: sim}}
"""
        with gateway_thread(config) as gw:
            yield up, gw


def test_tool_use_both_ways_through_a_chat_backend(scripted: tuple[ScriptedUpstream, RunningGateway]) -> None:
    up, gw = scripted
    up.script(Raw(http_answer(json.dumps(TOOL_CALL).encode()), close=False))
    sdk = client(gw)
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    first = sdk.messages.create(
        model="gpt",
        max_tokens=100,
        tools=TOOLS,
        tool_choice={"type": "auto"},
        system="Use tools.",
        stop_sequences=["END"],
        metadata={"user_id": "user-7"},
        messages=messages,
    )
    assert first.stop_reason == "tool_use"
    use = first.content[0]
    assert use.type == "tool_use"
    assert use.name == "get_weather"
    assert use.input == {"city": "Paris"}
    assert first.usage.input_tokens == 8
    assert first.usage.cache_read_input_tokens == 32
    sent = up.requests[-1]
    assert sent.path == "/v1/chat/completions"
    assert sent.headers["authorization"] == "Bearer upstream-secret"
    assert sent.json["model"] == "gpt-up"
    assert sent.json["messages"][0] == {"role": "system", "content": "Use tools."}
    assert sent.json["tools"][0]["function"]["name"] == "get_weather"
    assert sent.json["tools"][0]["function"]["parameters"]["required"] == ["city"]
    assert sent.json["tool_choice"] == "auto"
    assert sent.json["stop"] == ["END"]
    assert sent.json["user"] == "user-7"
    # The tool's result goes back: a tool message right after the assistant's call.
    up.script(Raw(streamed_tool_call(), close=False))
    messages += [
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"},
                {"type": "text", "text": "And in Oslo?"},
            ],
        },
    ]
    with sdk.messages.stream(model="gpt", max_tokens=100, tools=TOOLS, messages=messages) as stream:
        kinds = [event.type for event in stream]
        second = stream.get_final_message()
    sent = up.requests[-1].json
    assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "tool", "user"]
    assert sent["messages"][1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    assert sent["messages"][2] == {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}
    assert sent["stream_options"] == {"include_usage": True}
    assert "input_json" in kinds
    assert [block.type for block in second.content] == ["text", "tool_use"]
    assert second.content[1].input == {"city": "Oslo"}
    assert second.stop_reason == "tool_use"
    assert second.usage.output_tokens == 12
    assert second.usage.input_tokens == 50


def test_overload_and_fallback(scripted: tuple[ScriptedUpstream, RunningGateway]) -> None:
    up, gw = scripted
    up.script(Status(503))
    raw = client(gw).messages.with_raw_response.create(
        model="gpt", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
    )
    assert raw.headers["x-sluice-model"] == "backup"
    assert raw.headers["x-sluice-fallback"] == "error"
    assert raw.parse().content[0].type == "text"


def test_an_upstream_refusal_keeps_its_status(scripted: tuple[ScriptedUpstream, RunningGateway]) -> None:
    up, gw = scripted
    body = {"error": {"message": "max_tokens is too large", "type": "invalid_request_error", "param": "max_tokens"}}
    up.script(Status(400, body))
    with pytest.raises(anthropic.BadRequestError) as refused:
        client(gw).messages.create(model="gpt", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens is too large"},
    }


def test_top_k_is_refused_for_openai(scripted: tuple[ScriptedUpstream, RunningGateway]) -> None:
    _, gw = scripted
    ask = {"role": "user", "content": "hi"}
    with pytest.raises(anthropic.BadRequestError) as refused:
        client(gw).messages.create(model="gpt", max_tokens=10, messages=[ask], extra_body={"top_k": 5})
    assert "top_k" in refused.value.message


AUTHED = f"""
backends:
  sim: {{type: simulated, ttft_ms: 5, tpot_ms: 1, tokens: 4}}
models:
  chat: {{backend: sim}}
tenants:
  acme:
    keys: ["{HASH}"]
    rate_limit: {{requests_per_minute: 3}}
plugins: [auth, rate_limit, cache]
cache: {{mode: deterministic}}
"""


@pytest.fixture(scope="module")
def authed() -> Iterator[RunningGateway]:
    with gateway_thread(AUTHED) as gw:
        yield gw


def test_auth_limits_and_cache(authed: RunningGateway) -> None:
    with pytest.raises(anthropic.AuthenticationError) as refused:
        client(authed, "sk-wrong").messages.create(
            model="chat", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    # x-api-key (the SDK's way), then a bearer token (Claude Code's ANTHROPIC_AUTH_TOKEN): both are the key.
    ask = {"model": "chat", "max_tokens": 5, "messages": [{"role": "user", "content": "cache me"}]}
    first = client(authed, KEY).messages.with_raw_response.create(**ask, extra_body={"temperature": 0})
    assert first.headers["x-sluice-cache"] == "miss"
    bearer: Any = anthropic.Anthropic(base_url=authed.url, auth_token=KEY, max_retries=0)
    with bearer.messages.with_streaming_response.create(**ask, stream=True, extra_body={"temperature": 0}) as second:
        assert second.headers["x-sluice-cache"] == "hit"
        replayed = b"".join(second.iter_bytes())
    assert replayed.count(b"event: message_stop") == 1
    deltas = [json.loads(line[5:]) for line in replayed.splitlines() if line.startswith(b"data:")]
    text = "".join(e["delta"]["text"] for e in deltas if e["type"] == "content_block_delta")
    assert text == first.parse().content[0].text
    ask = {"model": "chat", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    client(authed, KEY).messages.create(**ask)  # the third request this minute: the limit
    with pytest.raises(anthropic.RateLimitError) as limited:
        client(authed, KEY).messages.create(**ask)
    assert limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert limited.value.response.headers.get("retry-after")


async def test_the_asgi_path_answers_the_same() -> None:
    """Under another ASGI server (or uvicorn with options the direct path does not take) the app serves the
    Messages routes itself: the same answers, errors in the same shape."""
    app = create_app(parse(SIM, "<test config>"))
    async with app.lifespan(app.site):

        async def call(method: str, path: str, body: dict[str, Any] | None) -> tuple[int, dict[bytes, bytes], bytes]:
            data = orjson.dumps(body) if body is not None else b""
            sent: list[dict[str, Any]] = []

            async def receive() -> dict[str, Any]:
                return {"type": "http.request", "body": data, "more_body": False}

            async def send(message: Any) -> None:
                sent.append(message)

            scope = {"type": "http", "method": method, "path": path, "query_string": b"beta=true", "headers": []}
            await app(scope, receive, send)
            head = sent[0]
            return head["status"], dict(head["headers"]), b"".join(m.get("body", b"") for m in sent[1:])

        ask = {"model": "chat-large", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        status, headers, body = await call("POST", "/v1/messages", ask)
        assert status == 200
        assert orjson.loads(body)["usage"]["output_tokens"] == 4
        assert headers[b"x-sluice-model"] == b"chat-large"
        status, headers, body = await call("POST", "/v1/messages", {**ask, "stream": True})
        assert status == 200
        assert body.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
        status, headers, body = await call("POST", "/v1/messages/count_tokens", {**ask, "model": "nope"})
        assert status == 404
        assert orjson.loads(body)["error"]["type"] == "not_found_error"
        assert headers[b"x-should-retry"] == b"false"
        status, _, _ = await call("GET", "/v1/messages", None)
        assert status == 405


def test_a_session_gets_an_openai_prompt_cache_key(scripted: tuple[ScriptedUpstream, RunningGateway]) -> None:
    up, gw = scripted
    ask = {"model": "gpt", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    client(gw).messages.create(**ask, extra_headers={"x-claude-code-session-id": "session-1"})
    expected = hashlib.sha256(b"anonymous\0session-1").hexdigest()[:32]
    assert up.requests[-1].json["prompt_cache_key"] == expected
    client(gw).messages.create(**ask, metadata={"user_id": "session-1"})
    assert up.requests[-1].json["prompt_cache_key"] == expected  # the same session, named in the body
    client(gw).messages.create(**ask)
    assert "prompt_cache_key" not in up.requests[-1].json  # no session: nothing to key
