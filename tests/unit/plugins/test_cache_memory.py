"""The cache's L1 stays within its bounds, and what it accounts for an entry covers what the entry holds."""

from __future__ import annotations

import sys
import time
import tracemalloc
from typing import Any

import orjson

from gateway.config import parse
from gateway.plugin import Outcome, ResponseHead
from gateway.server import request
from plugins.cache import ENTRY_OVERHEAD, Cache, Entry
from plugins.cache.l1 import L1
from tests.support.plugins import make

ANSWER: dict[str, Any] = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "word " * 40}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 40, "total_tokens": 45},
}


def cache(entries: int, size: int) -> Cache:
    yaml = f"""
backends: {{s: {{type: simulated}}}}
models: {{m: {{backend: s}}}}
cache: {{mode: always, l1_entries: {entries}, l1_bytes: {size}}}
plugins: [cache]
"""
    return make(Cache, parse(yaml, "<test>"))


async def fill(plugin: Cache, prompt: str, stream: bool = False) -> None:
    """One miss through the plugin's hooks, answered with ANSWER, as the pipeline runs them."""
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}], "stream": stream})
    ex = request.parse("chat/completions", [], body, time.perf_counter(), "rid")
    assert await plugin.on_request(ex) is None
    tap = await plugin.on_response(ex, ResponseHead(200, []))
    assert tap is not None
    tap(orjson.dumps(ANSWER))
    tap(b"")
    plugin.on_complete(ex, Outcome(200, complete=True, usage=ANSWER["usage"]))


async def hit(plugin: Cache, prompt: str, include_usage: bool) -> bytes:
    options = {"include_usage": include_usage}
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}], "stream": True, **{
        "stream_options": options}})  # fmt: skip
    ex = request.parse("chat/completions", [], body, time.perf_counter(), "rid")
    reply = await plugin.on_request(ex)
    assert reply is not None
    assert reply.source == "cache"
    return reply.body


def accounted(plugin: Cache) -> int:
    return sum(entry.size for entry in plugin.l1.values())


async def test_unique_prompts_never_take_l1_past_its_entries_or_its_bytes() -> None:
    by_entries, by_bytes = cache(entries=200, size=10_000_000), cache(entries=100_000, size=300_000)
    for i in range(2000):
        await fill(by_entries, f"prompt {i}")
        await fill(by_bytes, f"prompt {i}")
    assert len(by_entries.l1) == 200
    assert 0 < by_bytes.l1.bytes <= 300_000
    assert accounted(by_bytes) == by_bytes.l1.bytes
    assert len(by_bytes.l1) < 300_000 // len(orjson.dumps(ANSWER))
    assert by_entries.stats["stored"] == by_bytes.stats["stored"] == 2000


async def test_stream_replays_are_counted_and_still_bounded() -> None:
    plugin = cache(entries=100_000, size=400_000)
    for i in range(1000):
        await fill(plugin, f"prompt {i}")
        # Every entry is then replayed in both SSE forms, which more than doubles what it holds.
        assert b"data: [DONE]" in await hit(plugin, f"prompt {i}", include_usage=False)
        assert b'"usage":{' in await hit(plugin, f"prompt {i}", include_usage=True)
    entries = list(plugin.l1.values())
    assert all(entry.streams is not None and len(entry.streams) == 2 for entry in entries)
    assert plugin.l1.bytes == accounted(plugin) <= 400_000
    assert all(entry.size > 3 * len(entry.json) for entry in entries)


def test_an_entry_holds_no_more_than_l1_accounts_for_it() -> None:
    data = orjson.dumps(ANSWER)
    plugin = cache(entries=100_000, size=1 << 30)
    count = 5000
    keys = [f"sluice:cache:v2:{i:064x}" for i in range(count)]
    bodies = [bytes(data) for _ in range(count)]  # as they arrive from the upstream, before the cache sees them
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for key, body in zip(keys, bodies, strict=True):
            plugin._keep(key, Entry("chat/completions", "m", body, time.time() + 60, time.time() + 120))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # What the entries took beyond their bytes, plus their keys (made per request, then kept by L1).
    overhead = held / count + sys.getsizeof(keys[0])
    assert overhead <= ENTRY_OVERHEAD
    assert plugin.l1.bytes == count * (len(data) + ENTRY_OVERHEAD)


class Sized:
    def __init__(self, size: int, expires: float) -> None:
        self.size, self.expires = size, expires


def test_l1_evicts_the_least_recently_used_and_drops_expired_entries() -> None:
    l1: L1[Sized] = L1(max_entries=3, max_bytes=100)
    later = time.time() + 60
    for key in "abc":
        l1.put(key, Sized(10, later))
    assert l1.get("a") is not None  # a is now the most recently used: b goes first
    l1.put("d", Sized(10, later))
    assert list(l1.entries) == ["c", "a", "d"]
    assert l1.bytes == 30
    l1.put("e", Sized(75, later))  # over the bytes: c, the oldest, goes
    assert list(l1.entries) == ["a", "d", "e"]
    assert l1.bytes == 95
    l1.put("d", Sized(20, later))  # stored again, grown: counted anew, and a goes to make room
    assert list(l1.entries) == ["e", "d"]
    assert l1.bytes == 95
    l1.put("x", Sized(101, later))  # larger than the whole level: not kept
    assert "x" not in l1.entries
    assert l1.bytes == 95
    l1.put("old", Sized(5, time.time() - 1))
    assert l1.bytes == 100
    assert l1.get("old") is None  # expired: dropped
    assert list(l1.entries) == ["e", "d"]
    assert l1.bytes == 95
