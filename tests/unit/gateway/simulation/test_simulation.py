"""The scripted answers of the simulated upstream, and the in-process backend that plays them."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time
from typing import Any, cast

import orjson
import pytest
from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from gateway.context import Exchange, Target
from gateway.simulation.answers import JSON, SSE, WORDS, Profile, Reply, chat_tokens, error_reply, simulate
from gateway.upstream.connection import ResponseClosed
from gateway.upstream.providers.simulated import SimulatedProvider
from gateway.wire.completion import DONE_EVENT as DONE
from gateway.wire.completion import sse

PROFILE = Profile(ttft_ms=100.0, tpot_ms=10.0, tokens=6, embedding_dim=8)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


def chat(profile: Profile = PROFILE, **fields: Any) -> Reply:
    return simulate("chat/completions", {**CHAT, **fields}, "served-model", profile)


def body(reply: Reply) -> Any:
    assert len(reply.pieces) == 1
    return orjson.loads(reply.pieces[0])


def events(reply: Reply) -> list[dict[str, Any]]:
    """The JSON events of a stream, checking the SSE framing and the final [DONE]."""
    assert reply.stream
    assert reply.content_type == SSE
    assert reply.pieces[-1] == DONE
    for piece in reply.pieces:
        assert piece.startswith(b"data: ")
        assert piece.endswith(b"\n\n")
        assert piece.count(b"\n\n") == 1
    return [orjson.loads(piece[len(b"data: ") :]) for piece in reply.pieces[:-1]]


def content(reply: Reply) -> str:
    return "".join(event["choices"][0]["delta"].get("content") or "" for event in events(reply) if event["choices"])


# Chat completions


def test_chat_answer_parses_as_an_sdk_chat_completion() -> None:
    reply = chat()
    assert (reply.status, reply.content_type) == (200, JSON)
    completion = ChatCompletion.model_validate(body(reply))
    assert completion.object == "chat.completion"
    assert completion.model == "served-model"
    assert completion.id.startswith("chatcmpl-")
    assert len(completion.id) > len("chatcmpl-")
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 6
    assert completion.usage.prompt_tokens == 2 + 4  # two words and one message
    assert completion.usage.total_tokens == 12


def test_chat_text_is_deterministic_per_prompt() -> None:
    first, again = body(chat()), body(chat())
    other = body(chat(messages=[{"role": "user", "content": "something else"}]))
    assert first["id"] == again["id"]
    assert first["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]
    assert first["id"] != other["id"]
    assert first["choices"][0]["message"]["content"] != other["choices"][0]["message"]["content"]


def test_chat_text_has_one_known_word_per_token() -> None:
    words = body(chat())["choices"][0]["message"]["content"].split(" ")
    assert len(words) == 6
    assert all(word in WORDS for word in words)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_lower_token_limit_cuts_the_answer_with_finish_reason_length(field: str) -> None:
    answer = body(chat(PROFILE, **{field: 3}))
    assert answer["usage"]["completion_tokens"] == 3
    assert len(answer["choices"][0]["message"]["content"].split(" ")) == 3
    assert answer["choices"][0]["finish_reason"] == "length"


def test_a_higher_token_limit_leaves_the_natural_length() -> None:
    answer = body(chat(max_tokens=100))
    assert answer["usage"]["completion_tokens"] == 6
    assert answer["choices"][0]["finish_reason"] == "stop"


def test_an_answer_has_at_least_one_token() -> None:
    answer = body(chat(Profile(tokens=0)))
    assert answer["usage"]["completion_tokens"] == 1


def test_non_stream_delay_covers_the_whole_generation() -> None:
    reply = chat()
    assert reply.ttft_s == pytest.approx(0.100 + 5 * 0.010)
    assert reply.tpot_s == 0.0


def test_chat_stream_events_follow_the_openai_shape() -> None:
    reply = chat(stream=True)
    assert reply.ttft_s == pytest.approx(0.100)
    assert reply.tpot_s == pytest.approx(0.010)
    chunks = [ChatCompletionChunk.model_validate(event) for event in events(reply)]
    assert len(chunks) == 1 + 6 + 1  # role, tokens, finish
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    tokens = [chunk.choices[0].delta.content for chunk in chunks[1:-1]]
    assert all(token is not None for token in tokens)
    assert not tokens[0].startswith(" ")  # type: ignore[union-attr]
    assert all(token.startswith(" ") for token in tokens[1:])  # type: ignore[union-attr]
    assert chunks[-1].choices[0].delta.content is None
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(chunk.choices[0].finish_reason is None for chunk in chunks[:-1])
    assert {chunk.id for chunk in chunks} == {body(chat())["id"]}
    assert {chunk.object for chunk in chunks} == {"chat.completion.chunk"}
    assert {chunk.model for chunk in chunks} == {"served-model"}
    assert all("usage" not in event for event in events(reply))


def test_stream_and_non_stream_give_the_same_text() -> None:
    assert content(chat(stream=True)) == body(chat())["choices"][0]["message"]["content"]


def test_stream_cut_by_max_tokens_ends_with_length() -> None:
    reply = chat(stream=True, max_tokens=2)
    last = events(reply)[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    assert len(events(reply)) == 1 + 2 + 1


def test_include_usage_adds_a_usage_chunk_and_null_usage_before_it() -> None:
    all_events = events(chat(stream=True, stream_options={"include_usage": True}))
    *earlier, final = all_events
    assert final["choices"] == []
    assert final["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12}
    assert all("usage" in event and event["usage"] is None for event in earlier)
    ChatCompletionChunk.model_validate(final)


def test_include_usage_false_adds_nothing() -> None:
    all_events = events(chat(stream=True, stream_options={"include_usage": False}))
    assert all(event["choices"] and "usage" not in event for event in all_events)


def test_message_parts_are_counted_as_prompt_tokens() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "one two three"}, {"type": "image_url"}]},
        {"role": "assistant", "content": None},
    ]
    assert body(chat(messages=messages))["usage"]["prompt_tokens"] == 2 + 3 + 3 * 4


# Legacy completions


def test_completion_answer_parses_as_an_sdk_completion() -> None:
    reply = simulate("completions", {"model": "m", "prompt": "say something", "max_tokens": 4}, "m", PROFILE)
    completion = Completion.model_validate(body(reply))
    assert completion.object == "text_completion"
    assert completion.id.startswith("cmpl-")
    assert len(completion.choices[0].text.split(" ")) == 4
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 4


def test_completion_stream_carries_text_chunks() -> None:
    fields = {"model": "m", "prompt": ["say", "something"], "stream": True, "stream_options": {"include_usage": True}}
    all_events = events(simulate("completions", fields, "m", PROFILE))
    assert len(all_events) == 6 + 2  # tokens, finish, usage
    *tokens, finish, usage = all_events
    # The SDK reads stream chunks leniently; its strict model wants a finish reason, which only the end has.
    for event in tokens:
        assert event["object"] == "text_completion"
        assert event["usage"] is None
        assert event["choices"] == [
            {"text": event["choices"][0]["text"], "index": 0, "logprobs": None, "finish_reason": None}
        ]
    assert Completion.model_validate(finish).choices[0].finish_reason == "stop"
    assert Completion.model_validate(usage).usage is not None
    assert usage["choices"] == []
    text = "".join(event["choices"][0]["text"] for event in tokens)
    plain = simulate("completions", {**fields, "stream": False}, "m", PROFILE)
    assert text == body(plain)["choices"][0]["text"]


def test_completion_accepts_token_ids() -> None:
    reply = simulate("completions", {"model": "m", "prompt": [1, 2, 3]}, "m", PROFILE)
    assert body(reply)["usage"]["prompt_tokens"] == 3


# Embeddings


def test_embeddings_for_a_list_of_strings() -> None:
    reply = simulate("embeddings", {"model": "e", "input": ["a b", "c"]}, "e", PROFILE)
    assert reply.ttft_s == pytest.approx(0.100)
    assert reply.tpot_s == 0.0
    response = CreateEmbeddingResponse.model_validate(body(reply))
    assert response.model == "e"
    assert [item.index for item in response.data] == [0, 1]
    assert all(len(item.embedding) == 8 for item in response.data)
    assert all(math.isclose(math.fsum(x * x for x in item.embedding), 1.0) for item in response.data)
    assert response.data[0].embedding != response.data[1].embedding
    assert response.usage.prompt_tokens == 3


def test_embeddings_are_deterministic_per_text() -> None:
    one = body(simulate("embeddings", {"input": "same"}, "e", PROFILE))
    two = body(simulate("embeddings", {"input": ["other", "same"]}, "e", PROFILE))
    assert one["data"][0]["embedding"] == two["data"][1]["embedding"]


def test_embeddings_in_base64_and_other_dimensions() -> None:
    fields = {"input": "text", "dimensions": 4}
    floats = body(simulate("embeddings", fields, "e", PROFILE))["data"][0]["embedding"]
    encoded = body(simulate("embeddings", {**fields, "encoding_format": "base64"}, "e", PROFILE))["data"][0]
    decoded = struct.unpack("<4f", base64.b64decode(encoded["embedding"]))
    assert len(floats) == 4
    assert decoded == pytest.approx(floats, rel=1e-6)


# Errors


@pytest.mark.parametrize(
    ("endpoint", "fields", "param"),
    [
        ("chat/completions", {}, "messages"),
        ("chat/completions", {"messages": []}, "messages"),
        ("chat/completions", {"messages": "hi"}, "messages"),
        ("chat/completions", {"messages": [{"content": "no role"}]}, "messages[0]"),
        ("chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ("chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
        ("chat/completions", {**CHAT, "max_tokens": "5"}, "max_tokens"),
        ("chat/completions", {**CHAT, "stream": "yes"}, "stream"),
        ("chat/completions", {**CHAT, "stream": True, "stream_options": []}, "stream_options"),
        ("completions", {}, "prompt"),
        ("completions", {"prompt": 12}, "prompt"),
        ("completions", {"prompt": ["a", 1]}, "prompt"),
        ("embeddings", {}, "input"),
        ("embeddings", {"input": []}, "input"),
        ("embeddings", {"input": {"text": "a"}}, "input"),
        ("embeddings", {"input": "a", "dimensions": 0}, "dimensions"),
        ("embeddings", {"input": "a", "encoding_format": "hex"}, "encoding_format"),
    ],
)
def test_bad_bodies_get_an_openai_400(endpoint: str, fields: dict[str, Any], param: str) -> None:
    reply = simulate(endpoint, fields, "m", PROFILE)
    assert (reply.status, reply.content_type, reply.ttft_s) == (400, JSON, 0.0)
    error = body(reply)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["code"] is None
    assert isinstance(error["message"], str)
    assert error["message"]


def test_unknown_endpoint_is_a_404() -> None:
    assert simulate("audio/speech", CHAT, "m", PROFILE).status == 404


def test_error_reply_shape() -> None:
    assert body(error_reply(404, "nope")) == {
        "error": {"message": "nope", "type": "invalid_request_error", "param": None, "code": None}
    }


# The in-process backend


def exchange(fields: dict[str, Any], endpoint: str = "chat/completions") -> Exchange:
    return Exchange("req-1", endpoint, [], orjson.dumps(fields), fields, time.perf_counter())


def target(provider: SimulatedProvider) -> Target:
    return Target("public", "sim", "upstream-name", cast(Any, None), provider)


async def test_provider_plays_a_stream_with_its_delays() -> None:
    provider = SimulatedProvider(Profile(ttft_ms=60.0, tpot_ms=20.0, tokens=3))
    await provider.start()
    assert provider.ready
    assert provider.kind == "simulated"
    assert provider.system == "openai"
    started = time.perf_counter()
    response = await provider.send(exchange({**CHAT, "stream": True}), target(provider))
    assert time.perf_counter() - started < 0.03  # the head is ready at once
    assert response.status == 200
    assert dict(response.headers) == {b"content-type": SSE, b"x-request-id": b"req-1"}
    arrivals, pieces = [], []
    while piece := await response.next_chunk():
        arrivals.append(time.perf_counter() - started)
        pieces.append(piece)
    assert response.complete
    assert len(pieces) == 1 + 3 + 1 + 1 + 1  # role, tokens, finish, usage (always reported), [DONE]
    assert pieces[-1] == DONE
    assert b'"choices":[],"usage":{' in pieces[-2]
    assert b'"model":"upstream-name"' in pieces[0]
    assert arrivals[0] >= 0.055
    assert arrivals[-1] - arrivals[0] >= 6 * 0.020 * 0.8
    assert await response.next_chunk() == b""
    await provider.aclose()


async def test_provider_non_stream_body_comes_after_the_whole_generation() -> None:
    provider = SimulatedProvider(Profile(ttft_ms=40.0, tpot_ms=20.0, tokens=4))
    started = time.perf_counter()
    response = await provider.send(exchange(CHAT), target(provider))
    assert not response.complete
    answer = ChatCompletion.model_validate_json(await response.read())
    assert time.perf_counter() - started >= (0.040 + 3 * 0.020) * 0.95
    assert response.complete
    assert answer.model == "upstream-name"


async def test_provider_passes_errors_through() -> None:
    provider = SimulatedProvider(PROFILE)
    response = await provider.send(exchange({"model": "m"}), target(provider))
    assert response.status == 400
    assert b"invalid_request_error" in await response.read()


async def test_closed_response_raises_response_closed() -> None:
    provider = SimulatedProvider(Profile(ttft_ms=0.0, tpot_ms=0.0, tokens=3))
    response = await provider.send(exchange({**CHAT, "stream": True}), target(provider))
    assert await response.next_chunk()
    response.close()
    with pytest.raises(ResponseClosed):
        await response.next_chunk()


async def test_close_wakes_a_waiting_reader() -> None:
    provider = SimulatedProvider(Profile(ttft_ms=5000.0, tpot_ms=0.0, tokens=3))
    response = await provider.send(exchange({**CHAT, "stream": True}), target(provider))
    reader = asyncio.create_task(response.next_chunk())
    await asyncio.sleep(0.01)
    response.close()
    with pytest.raises(ResponseClosed):
        await asyncio.wait_for(reader, 1.0)


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "hello there  world"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "a b"}]}],
        [{"role": "assistant", "content": None}, {"role": "user", "content": ""}],
    ],
)
def test_chat_tokens_count_as_usage_counts_prompt_tokens(messages: Any) -> None:
    reply = simulate("chat/completions", {"messages": messages}, "m", Profile())
    assert len(chat_tokens(messages)) == orjson.loads(reply.pieces[0])["usage"]["prompt_tokens"]


def test_chat_tokens_of_a_later_turn_extend_the_earlier_turn() -> None:
    first = [{"role": "user", "content": "one two"}]
    later = [*first, {"role": "assistant", "content": "three"}, {"role": "user", "content": "four"}]
    assert chat_tokens(later)[: len(chat_tokens(first))] == chat_tokens(first)


def test_cached_tokens_are_reported_in_prompt_tokens_details() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": {"include_usage": True}}
    whole = simulate("chat/completions", {"messages": body["messages"]}, "m", Profile(), cached_tokens=16)
    assert orjson.loads(whole.pieces[0])["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    stream = simulate("chat/completions", body, "m", Profile(tokens=3), cached_tokens=0)
    assert stream.tokens == 3
    assert len(stream.pieces) == 1 + 3 + 1 + 1 + 1
    assert orjson.loads(stream.pieces[-2][6:])["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert all(piece.startswith(b"data: ") and piece.endswith(b"\n\n") for piece in stream.pieces)
    assert sse(b"[DONE]") == DONE
