"""The relay hiding the usage it asked for: every way the upstream's reads can split the stream's tail."""

from __future__ import annotations

import itertools
from collections.abc import MutableMapping
from typing import Any

import orjson
import pytest

from gateway.plugin import Outcome
from gateway.server import request
from gateway.server.relay import COUNT, HIDE, PASS, relay_stream
from gateway.upstream.providers.http import request_body

HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
USAGE = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
DONE = b"data: [DONE]\n\n"


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def chunk(content: str | None, finish: str | None = None, usage: bool = True) -> bytes:
    delta = {} if content is None else {"content": content}
    payload: dict[str, Any] = {**HEAD, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage:
        payload["usage"] = None
    return event(payload)


def stream(usage: bool) -> list[bytes]:
    """Events as an upstream asked for usage sends them (usage=True), or as the client wants them."""
    parts = [chunk("", usage=usage), chunk("Hi", usage=usage), chunk(' "choices":[] ', usage=usage)]
    parts += [chunk("[]", usage=usage), chunk(None, "stop", usage=usage)]
    if usage:
        parts.append(event({**HEAD, "choices": [], "usage": USAGE}))
    return [*parts, DONE]


class Upstream:
    """The upstream's reads, as the connection pool hands them over."""

    def __init__(self, reads: list[bytes]) -> None:
        self.reads = reads[1:]

    async def next_chunk(self) -> bytes:
        return self.reads.pop(0) if self.reads else b""


async def relay(reads: list[bytes], mode: int, choices: int = 1) -> tuple[bytes, bytes, Outcome]:
    sent: list[bytes] = []
    tapped: list[bytes] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message["body"])

    outcome = Outcome(status=200)
    upstream: Any = Upstream(reads)
    await relay_stream(send, upstream, reads[0], outcome, (tapped.append,), 0.0, 0.0, mode, choices=choices)
    return b"".join(sent), b"".join(tapped), outcome


def splits(data: bytes, *cuts: int) -> list[bytes]:
    edges = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges) if b > a]


async def test_every_single_split_of_the_stream_gives_the_client_the_stream_it_asked_for() -> None:
    upstream, wanted = b"".join(stream(usage=True)), b"".join(stream(usage=False))
    for cut in range(1, len(upstream)):
        client, tapped, outcome = await relay(splits(upstream, cut), HIDE)
        assert client == wanted, cut
        assert tapped == wanted  # plugins (the cache) see what the client sees
        assert outcome.complete
        assert outcome.error is None
        assert outcome.usage == USAGE
        assert outcome.usage_source == "upstream"


@pytest.mark.parametrize(
    "shape",
    [
        "usage split across reads",
        "usage and [DONE] in one read",
        "content and usage in one read",
        "finish, usage and [DONE] in one read",
        "one read per event",
        "everything in one read",
    ],
)
async def test_the_tail_in_each_shape(shape: str) -> None:
    events = stream(usage=True)
    *content, finish, usage, done = events
    reads = {
        "usage split across reads": [*content, finish, usage[:20], usage[20:-1], usage[-1:], done],
        "usage and [DONE] in one read": [*content, finish, usage + done],
        "content and usage in one read": [*content, finish + usage, done],
        "finish, usage and [DONE] in one read": [*content, finish + usage + done],
        "one read per event": events,
        "everything in one read": [b"".join(events)],
    }[shape]
    client, _, outcome = await relay(reads, HIDE)
    assert client == b"".join(stream(usage=False))
    assert outcome.usage == USAGE
    assert outcome.complete


async def test_a_client_that_asked_gets_the_stream_unchanged() -> None:
    events = stream(usage=True)
    client, _, outcome = await relay([events[0], b"".join(events[1:])], PASS)
    assert client == b"".join(events)
    assert outcome.usage == USAGE


async def test_an_upstream_without_usage_has_its_tokens_estimated() -> None:
    events = stream(usage=False)
    client, _, outcome = await relay(events, COUNT)
    assert client == b"".join(events)
    assert outcome.usage_source == "estimated"
    assert outcome.usage == {"completion_tokens": len(events) - 2}


async def test_an_azure_preamble_with_empty_choices_is_not_mistaken_for_usage() -> None:
    preamble = event({"id": "", "object": "", "created": 0, "model": "", "choices": [], "prompt_filter_results": []})
    events = [preamble, *stream(usage=True)]
    client, _, outcome = await relay(events, HIDE)
    assert client == preamble + b"".join(stream(usage=False))
    assert outcome.usage == USAGE


async def test_a_stream_cut_short_keeps_no_half_event_before_the_error() -> None:
    events = stream(usage=True)
    client, _, outcome = await relay([*events[:3], events[3][:10]], HIDE)
    assert not outcome.complete
    assert outcome.error is not None
    assert client.startswith(b"".join(stream(usage=False)[:3]))
    assert b'data: {"error"' in client
    assert events[3][:10] not in client[-200:]


def body_sent(fields: dict[str, Any], model: str | None = None, usage: bool = True) -> dict[str, Any]:
    ex = request.parse("chat/completions", [], orjson.dumps(fields), 0.0, "rid")
    sent = request_body(ex, model, usage)
    if sent is ex.body:
        return {"unchanged": True}
    parsed: dict[str, Any] = orjson.loads(sent)
    return parsed


def test_streams_are_asked_for_usage_once_and_nothing_else_changes() -> None:
    base: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    stream = {**base, "stream": True}
    assert body_sent(stream) == {**stream, "stream_options": {"include_usage": True}}
    kept = {**stream, "stream_options": {"include_obfuscation": False}}
    assert body_sent(kept) == {**stream, "stream_options": {"include_obfuscation": False, "include_usage": True}}
    assert body_sent(stream, model="up") == {**stream, "model": "up", "stream_options": {"include_usage": True}}
    assert body_sent({**stream, "stream_options": {"include_usage": True}}) == {"unchanged": True}
    assert body_sent(base) == {"unchanged": True}
    assert body_sent(stream, usage=False) == {"unchanged": True}
    assert body_sent(base, model="up") == {**base, "model": "up"}


def tgi_stream(usage: bool, spaced: bool = False) -> list[bytes]:
    """TGI 2.3 to 3.1: the usage on the last content chunk (the finish reason's), no usage-only chunk."""
    parts = [chunk("Hi", usage=usage), chunk(' "usage":{} ', usage=usage)]
    finish: dict[str, Any] = {**HEAD, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    if usage:
        finish["usage"] = USAGE
    last = event(finish)
    if spaced:  # as Python's json writes it
        last = last.replace(b'"usage":{', b'"usage": {').replace(b'],"usage"', b'], "usage"')
    return [*parts, last, DONE]


async def test_usage_on_the_last_content_chunk_is_counted_and_cut_from_that_chunk_only() -> None:
    upstream, wanted = b"".join(tgi_stream(usage=True)), b"".join(tgi_stream(usage=False))
    for cut in range(1, len(upstream)):
        client, tapped, outcome = await relay(splits(upstream, cut), HIDE)
        assert client == wanted, cut
        assert tapped == wanted
        assert outcome.usage == USAGE
        assert outcome.complete
    client, _, outcome = await relay(tgi_stream(usage=True, spaced=True), HIDE)
    assert client == b"".join(tgi_stream(usage=False))
    assert outcome.usage == USAGE
    last = orjson.loads(client.split(b"\n\n")[-3][len(b"data: ") :])
    assert last["choices"][0]["finish_reason"] == "length"  # the chunk is kept, only its usage goes
    assert "usage" not in last


async def test_usage_on_the_last_content_chunk_reaches_a_client_that_asked_unchanged() -> None:
    events = tgi_stream(usage=True)
    client, _, outcome = await relay(events, PASS)
    assert client == b"".join(events)
    assert outcome.usage == USAGE


def choices_stream(usage: bool) -> list[bytes]:
    """llama.cpp with n=2: the choices interleave, each ends with its own finish chunk and usage-only chunk."""

    def piece(index: int, content: str | None, finish: str | None = None) -> bytes:
        delta = {} if content is None else {"content": content}
        return event({**HEAD, "choices": [{"index": index, "delta": delta, "finish_reason": finish}]})

    def used(completion: int) -> bytes:
        counts = {"completion_tokens": completion, "prompt_tokens": 3, "total_tokens": 3 + completion}
        details = {"prompt_tokens_details": {"cached_tokens": 2}}
        # `choices` after `usage` (as a dict updated in place writes them): either order is a usage-only chunk.
        return event({**HEAD, "timings": {"prompt_n": 1}, "usage": {**counts, **details}, "choices": []})

    parts = [piece(0, "a"), piece(1, "b"), piece(1, None, "stop")]
    if usage:
        parts.append(used(2))
    parts += [piece(0, "c"), piece(0, "d"), piece(0, None, "length")]
    if usage:
        parts.append(used(4))
    return [*parts, DONE]


async def test_one_usage_chunk_per_choice_is_summed_and_every_one_hidden() -> None:
    upstream, wanted = b"".join(choices_stream(usage=True)), b"".join(choices_stream(usage=False))
    summed = {
        "completion_tokens": 6,
        "prompt_tokens": 3,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    for cut in range(1, len(upstream), 7):
        client, _, outcome = await relay(splits(upstream, cut), HIDE)
        assert client == wanted, cut
        assert outcome.usage == summed
    events = choices_stream(usage=True)
    for reads in (events, [b"".join(events)], [events[0], b"".join(events[1:4]), b"".join(events[4:])]):
        client, _, outcome = await relay(reads, PASS, choices=2)
        assert client == b"".join(events)
        assert outcome.usage == summed
