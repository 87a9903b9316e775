"""Assembling streamed answers and replaying stored ones: whole answers only, tool calls included."""

from __future__ import annotations

import orjson
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessageFunctionToolCall

from gateway.wire.completion import assemble, events, replay


def sse(*chunks: dict[str, object], done: bool = True) -> bytes:
    body = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks)
    return body + (b"data: [DONE]\n\n" if done else b"")


HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def delta(content: object = None, finish: str | None = None, **extra: object) -> dict[str, object]:
    d: dict[str, object] = {} if content is None else {"content": content}
    d.update(extra)
    return {**HEAD, "choices": [{"index": 0, "delta": d, "finish_reason": finish}]}


def test_text_stream_assembles_and_replays_identically() -> None:
    body = sse(
        delta(role="assistant", content=""),
        delta("Hello"),
        delta(" world"),
        delta(finish="stop"),
        {**HEAD, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}},
    )
    answer = assemble("chat/completions", body)
    assert answer is not None
    parsed = ChatCompletion.model_validate(answer)
    assert parsed.choices[0].message.content == "Hello world"
    assert parsed.usage is not None
    assert parsed.usage.total_tokens == 5
    replayed = replay("chat/completions", answer, include_usage=True)
    chunks, done = events(replayed)
    assert done
    models = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert "".join(c.choices[0].delta.content or "" for c in models if c.choices) == "Hello world"
    assert models[-1].usage is not None
    assert models[-1].choices == []
    assert assemble("chat/completions", replayed) == answer


def test_tool_calls_are_merged() -> None:
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"a"'}}
    more = {"index": 0, "function": {"arguments": ": 1}"}}
    body = sse(delta(role="assistant", tool_calls=[call]), delta(tool_calls=[more]), delta(finish="tool_calls"))
    answer = assemble("chat/completions", body)
    assert answer is not None
    message = ChatCompletion.model_validate(answer).choices[0].message
    assert message.tool_calls is not None
    tool_call = message.tool_calls[0]
    assert isinstance(tool_call, ChatCompletionMessageFunctionToolCall)
    assert tool_call.function.arguments == '{"a": 1}'
    assert assemble("chat/completions", replay("chat/completions", answer, False)) == answer


def test_incomplete_streams_do_not_assemble() -> None:
    assert assemble("chat/completions", sse(delta("Hi"), delta(finish="stop"), done=False)) is None
    assert assemble("chat/completions", sse(delta("Hi"))) is None  # no finish reason
    assert assemble("chat/completions", sse(delta("Hi"), {"error": {"message": "x"}})) is None
    assert assemble("chat/completions", b"") is None


def test_legacy_completions() -> None:
    chunk = {"id": "c", "object": "text_completion", "created": 1, "model": "m"}
    body = sse(
        {**chunk, "choices": [{"index": 0, "text": "ab", "finish_reason": None}]},
        {**chunk, "choices": [{"index": 0, "text": "c", "finish_reason": "length"}]},
    )
    answer = assemble("completions", body)
    assert answer is not None
    assert answer["choices"][0]["text"] == "abc"
    assert assemble("completions", replay("completions", answer, False)) == answer
