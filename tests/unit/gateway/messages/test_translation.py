"""The Messages API's translations, field by field: request to chat completions, chat answers back (whole and
streamed, split anywhere), the Messages stream replayed and assembled, usage in both APIs' names."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.messages.backends import renamed
from gateway.messages.chat_reply import StreamTranslator, whole
from gateway.messages.chat_request import to_chat, with_top_k
from gateway.messages.refusals import Refusal, anthropic_body, status_of, stream_error
from gateway.server.relay import counted, find_usage, messages_usage
from gateway.wire import completion, message_events


def request(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], **fields}


def test_request_fields() -> None:
    chat = to_chat(
        request(
            system=[
                {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "b"},
            ],
            temperature=0.2,
            top_p=0.9,
            stop_sequences=["X"],
            metadata={"user_id": "u"},
            stream=True,
            thinking={"type": "enabled", "budget_tokens": 1024},
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            tools=[{"name": "f", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}],
        ),
        "up",
    )
    assert chat == {
        "model": "up",
        "messages": [{"role": "system", "content": "a\n\nb"}, {"role": "user", "content": "hi"}],
        "max_tokens": 10,
        "temperature": 0.2,
        "top_p": 0.9,
        "stop": ["X"],
        "user": "u",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_blocks_keep_their_order_and_tool_results_come_first() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "AAAA"}}
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "see"},
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [{"type": "text", "text": "r"}],
                    "is_error": True,
                },
                image,
            ],
        },
        {"role": "system", "content": [{"type": "text", "text": "mid"}]},
    ]
    chat = to_chat(request(messages=messages), "up")["messages"]
    assert chat == [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "Error: r"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "see"},
                {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AAAA"}},
            ],
        },
        {"role": "system", "content": "mid"},
    ]


@pytest.mark.parametrize(
    "fields",
    [
        {"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]},
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        {"tool_choice": {"type": "weird"}},
        {"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "file", "file_id": "f"}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
        {"system": [{"type": "image"}]},
    ],
)
def test_what_cannot_be_translated_is_refused(fields: dict[str, Any]) -> None:
    with pytest.raises(Refusal):
        to_chat(request(**fields), "up")


def test_top_k_only_where_it_is_understood() -> None:
    body = request(top_k=5)
    chat = to_chat(body, "up")
    assert with_top_k(chat, body, "vllm", "b")["top_k"] == 5
    with pytest.raises(Refusal):
        with_top_k(chat, body, "openai", "b")


CHAT_ANSWER = {
    "id": "chatcmpl-abc",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "Hi",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{bad"}}],
            },
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {"prompt_tokens": 100, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 60}},
}


def test_whole_answer() -> None:
    message = orjson.loads(whole(orjson.dumps(CHAT_ANSWER), "pub"))
    assert message["id"] == "msg_abc"
    assert message["model"] == "pub"
    assert message["content"] == [
        {"type": "text", "text": "Hi"},
        {"type": "tool_use", "id": "c1", "name": "f", "input": {"_raw": "{bad"}},
    ]
    assert message["stop_reason"] == "tool_use"
    assert message["usage"] == {
        "input_tokens": 40,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 60,
        "output_tokens": 5,
    }
    assert list(message)[-1] == "usage"  # last, where the accounting reads it
    assert find_usage(whole(orjson.dumps(CHAT_ANSWER), "pub"))["prompt_tokens"] == 100  # type: ignore[index]


def chat_stream() -> bytes:
    head = {"id": "chatcmpl-s", "object": "chat.completion.chunk"}

    def event(delta: dict[str, Any], finish: str | None = None) -> bytes:
        chunk = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    call = {"index": 0, "id": "c1", "function": {"name": "f", "arguments": ""}}
    return b"".join(
        [
            event({"role": "assistant", "content": ""}),
            event({"content": "Hel"}),
            event({"content": "lo"}),
            event({"tool_calls": [call]}),
            event({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}),
            event({"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}),
            event({}, "tool_calls"),
            b'data: {"id":"chatcmpl-s","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4}}\n\n',
            b"data: [DONE]\n\n",
        ]
    )


def translate(pieces: list[bytes]) -> bytes:
    translator = StreamTranslator("pub", 7)
    return b"".join(translator.feed(piece) for piece in pieces)


@given(st.lists(st.integers(min_value=1, max_value=200), max_size=12))
def test_a_stream_split_anywhere_translates_the_same(cuts: list[int]) -> None:
    data = chat_stream()
    points = sorted({min(c * 7, len(data)) for c in cuts})
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    assert translate(pieces) == translate([data])


def test_stream_events() -> None:
    out = translate([chat_stream()])
    events = [json.loads(line[5:]) for line in out.splitlines() if line.startswith(b"data:")]
    names = [line[7:].decode() for line in out.splitlines() if line.startswith(b"event: ")]
    assert names == [event["type"] for event in events]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0]["message"]["usage"]["input_tokens"] == 7  # the estimate, until the stream's own count
    assert events[6]["content_block"] == {"type": "tool_use", "id": "c1", "name": "f", "input": {}}
    assert events[-2]["usage"]["input_tokens"] == 9
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    message = message_events.assemble(out)
    assert message is not None
    assert message["content"] == [
        {"type": "text", "text": "Hello"},
        {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}},
    ]
    assert message["usage"]["output_tokens"] == 4
    # The cache keeps it whole and replays it as a stream that assembles to the same message.
    kept = completion.finished("messages", out, None)
    assert kept is not None
    assert message_events.assemble(completion.replay("messages", orjson.loads(kept), True)) == message
    assert messages_usage(out, out[-400:])["completion_tokens"] == 4  # type: ignore[index]


def test_an_unfinished_stream_is_not_kept() -> None:
    out = translate([chat_stream().replace(b"data: [DONE]\n\n", b"")])
    assert b"message_stop" not in out
    assert completion.finished("messages", out, None) is None


def test_usage_in_chat_names() -> None:
    anthropic = counted({"input_tokens": 3, "cache_read_input_tokens": 10, "output_tokens": 2})
    assert (anthropic["prompt_tokens"], anthropic["completion_tokens"], anthropic["total_tokens"]) == (13, 2, 15)
    responses = counted({"input_tokens": 13, "output_tokens": 2, "total_tokens": 15})
    assert responses["prompt_tokens"] == 13
    start = b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":21}}}\n\n'
    end = b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":3}}\n\n'
    assert messages_usage(start, end) == {
        "input_tokens": 21,
        "output_tokens": 3,
        "prompt_tokens": 21,
        "completion_tokens": 3,
        "total_tokens": 24,
    }


def test_errors_in_anthropics_shape() -> None:
    body = b'{"error":{"message":"no","type":"invalid_request_error","param":null,"code":null}}'
    assert orjson.loads(anthropic_body(401, body)) == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "no"},
    }
    native = b'{"type":"error","error":{"type":"overloaded_error","message":"busy"}}'
    assert anthropic_body(529, native) == native
    assert status_of(503) == 529
    assert status_of(502) == 502
    event = stream_error(b'data: {"error":{"message":"cut","type":"upstream_error"}}\n\ndata: [DONE]\n\n')
    assert event == b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"cut"}}\n\n'


def test_renamed_touches_only_the_model() -> None:
    body = b'{"model" :  "a",\n "x": "\\/", "tools": [{"input_schema": {"model": "b"}}]}'
    assert renamed(body, "a", "big/model") == body.replace(b'"a"', b'"big/model"')
    # The same text elsewhere: no guess at which is the model; written again, the model changed.
    twice = b'{"model": "a", "tools": [{"input_schema": {"model": "a"}}]}'
    assert orjson.loads(renamed(twice, "a", "z")) == {"model": "z", "tools": [{"input_schema": {"model": "a"}}]}


def reasoning_stream() -> bytes:
    def event(delta: dict[str, Any], finish: str | None = None) -> bytes:
        chunk = {"id": "chatcmpl-r", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    return b"".join(
        [
            event({"role": "assistant", "content": ""}),
            event({"reasoning_content": "Think"}),
            event({"reasoning_content": "ing."}),
            event({"content": "Answer."}),
            event({}, "stop"),
            b"data: [DONE]\n\n",
        ]
    )


def test_reasoning_becomes_thinking_only_when_asked_for() -> None:
    asked = StreamTranslator("pub", 7, thinking=True).feed(reasoning_stream())
    message = message_events.assemble(asked)
    assert message is not None
    assert message["content"] == [
        {"type": "thinking", "thinking": "Thinking.", "signature": ""},
        {"type": "text", "text": "Answer."},
    ]
    not_asked = message_events.assemble(StreamTranslator("pub", 7).feed(reasoning_stream()))
    assert not_asked is not None
    assert not_asked["content"] == [{"type": "text", "text": "Answer."}]
    answer = {"id": "x", "choices": [{"message": {"content": "A", "reasoning_content": "R"}, "finish_reason": "stop"}]}
    blocks = orjson.loads(whole(orjson.dumps(answer), "pub", thinking=True))["content"]
    assert blocks == [{"type": "thinking", "thinking": "R", "signature": ""}, {"type": "text", "text": "A"}]
