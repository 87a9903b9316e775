"""The shared Redis client: bursts are pipelined on a few connections, a dead Redis fails fast and opens the breaker."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from gateway.state.store import Store, StoreUnavailable
from tests.support.redis import RedisServer
from tests.support.wait import until


async def test_a_burst_is_pipelined_on_a_few_connections_instead_of_failing(redis_server: RedisServer) -> None:
    store = Store(redis_server.url, connections=2)
    try:
        results = await asyncio.gather(*(store.execute("SET", f"k{i}", "v") for i in range(64)), return_exceptions=True)
        assert not [r for r in results if isinstance(r, BaseException)]
        assert store.failures == 0
        assert store.available
        clients = redis_server.client().client_list()
        assert len(clients) <= 3  # the store's two connections and this one
    finally:
        await store.aclose()


async def test_redis_down_fails_fast_then_skips_until_the_cooldown(redis_server: RedisServer) -> None:
    store = Store(redis_server.url, cooldown_s=0.5)
    try:
        assert await store.execute("PING")
        redis_server.stop()
        started = time.monotonic()
        for _ in range(20):
            with contextlib.suppress(StoreUnavailable):
                await store.execute("GET", "x")
        assert time.monotonic() - started < 3.0  # one failed try, then the breaker answers at once (a hang is 20 s)
        assert store.failures == 1
        assert not store.available
        redis_server.start()
        await until(lambda: store.available, what="the breaker's cool-down")
        assert await store.execute("PING")
    finally:
        await store.aclose()


async def test_a_call_sent_always_is_outside_the_breaker_both_ways(redis_server: RedisServer) -> None:
    store = Store(redis_server.url, cooldown_s=30.0)  # far longer than this test: only `always` gets through
    lease: list[list[str | int]] = [["SET", "lease", "1", "PX", 1000], ["GET", "lease"]]
    try:
        assert await store.execute("PING")
        redis_server.pause()
        try:
            with pytest.raises(StoreUnavailable):
                await store.pipeline(lease, always=True)  # times out...
            assert store.available  # ...and leaves the breaker closed for the request path
            with pytest.raises(StoreUnavailable):
                await store.execute("GET", "x")  # an ordinary call that times out opens it
        finally:
            redis_server.resume()
        assert not store.available
        with pytest.raises(StoreUnavailable, match="circuit open"):
            await store.execute("GET", "x")
        assert await store.pipeline(lease, always=True) == [b"OK", b"1"]
        assert not store.available  # its success closes nothing: the others' cool-down is unchanged
        assert store.failures == 2
    finally:
        await store.aclose()
