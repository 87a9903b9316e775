"""The lean RESP client against a real redis-server: pipelining, large and split replies, faults, recovery."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import redis
import trustme

from gateway.state.resp import Redis, ReplyError, parse_url
from gateway.state.store import Script, Store, StoreUnavailable
from tests.support.gateway import free_port
from tests.support.redis import RedisServer
from tests.support.wait import wait_until

# Keeps Redis busy for ARGV[1] ms (it runs one script at a time): a server that is slow, yet answers.
SPIN = """
local t = redis.call('TIME')
local start = t[1] * 1000 + t[2] / 1000
repeat
  t = redis.call('TIME')
until t[1] * 1000 + t[2] / 1000 - start >= tonumber(ARGV[1])
return 1
"""


def client(url: str, **limits: float) -> Redis:
    addresses, options, _ = parse_url(url, **limits)
    return Redis(url, addresses[0], options)


async def wait_for(check: object, timeout_s: float = 10.0) -> None:
    """Call the coroutine function `check` until it returns true, within a deadline."""
    assert callable(check)
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(StoreUnavailable):
            if await check():
                return
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_a_thousand_concurrent_gets_each_get_their_own_value(redis_server: RedisServer) -> None:
    with redis_server.client() as r:
        r.mset({f"k{i}": f"v{i}" for i in range(1000)})
    redis = client(redis_server.url, timeout_s=5.0)
    try:
        replies = await asyncio.gather(*(redis.call(("GET", f"k{i}")) for i in range(1000)))
        assert replies == [f"v{i}".encode() for i in range(1000)]
        assert len(redis.node.live) == 2  # all of them on two pipelined connections
    finally:
        await redis.aclose()


async def test_values_of_several_megabytes_go_both_ways_between_small_calls(redis_server: RedisServer) -> None:
    big = bytes(range(256)) * (6 * 4096)  # 6 MiB: many reads of the transport's buffer
    redis = client(redis_server.url, timeout_s=10.0)
    try:
        assert await redis.call(("SET", "big", big)) == b"OK"
        replies = await asyncio.gather(*(redis.call(("GET", "big" if i % 4 == 0 else "small")) for i in range(16)))
        assert all(r == big for r in replies[::4])
        assert all(r is None for i, r in enumerate(replies) if i % 4)
        assert await redis.pipeline([("STRLEN", "big"), ("GET", "big")]) == [len(big), big]
    finally:
        await redis.aclose()


async def test_an_error_reply_fails_only_its_own_call(redis_server: RedisServer) -> None:
    redis = client(redis_server.url)
    try:
        await redis.call(("SET", "s", "x"))
        results = await asyncio.gather(
            redis.call(("GET", "s")), redis.call(("HGET", "s", "f")), redis.call(("GET", "s")), return_exceptions=True
        )
        assert results[0] == results[2] == b"x"
        assert isinstance(results[1], ReplyError)
        assert str(results[1]).startswith("WRONGTYPE")
        replies = await redis.pipeline([("INCR", "s"), ("GET", "s")])
        assert isinstance(replies[0], ReplyError)
        assert replies[1] == b"x"
        with pytest.raises(ReplyError, match="unknown command"):
            await redis.call(("NOSUCHCOMMAND",))
    finally:
        await redis.aclose()


async def test_a_call_that_timed_out_does_not_shift_the_replies_after_it(redis_server: RedisServer) -> None:
    redis = client(redis_server.url, timeout_s=0.5, connections=1)
    try:
        await redis.call(("SET", "a", "right"))
        with pytest.raises(TimeoutError):
            await redis.call(("BLPOP", "queue", 0))  # blocks the connection until something is pushed
        later = [asyncio.ensure_future(redis.call(("GET", "a"))) for _ in range(3)]
        await asyncio.sleep(0)  # written behind the blocked BLPOP
        with redis_server.client() as r:
            r.lpush("queue", "stale")  # the BLPOP's reply now arrives, for a caller that is gone
        assert await asyncio.gather(*later) == [b"right"] * 3
        assert await redis.call(("LLEN", "queue")) == 0
    finally:
        await redis.aclose()


async def test_credentials_and_database_from_the_url(redis_server: RedisServer) -> None:
    with redis_server.client() as r:
        r.acl_setuser("app", enabled=True, passwords=["+s3cret"], commands=["+@all"], keys=["*"])
    host = f"127.0.0.1:{redis_server.port}"
    redis = client(f"redis://app:s3cret@{host}/3")
    wrong = Store(f"redis://app:nope@{host}/3")
    try:
        assert await redis.call(("SET", "where", "db3")) == b"OK"
        with redis_server.client() as r:
            r.execute_command("SELECT", 3)
            assert r.get("where") == b"db3"
        with pytest.raises(StoreUnavailable, match="WRONGPASS"):
            await wrong.execute("PING")
    finally:
        await redis.aclose()
        await wrong.aclose()


async def test_a_restarted_server_fails_calls_fast_then_serves_again(redis_server: RedisServer) -> None:
    store = Store(redis_server.url, cooldown_s=0.2)
    try:
        assert await store.execute("SET", "x", "1") == b"OK"
        redis_server.stop()
        started = time.monotonic()
        for _ in range(50):
            with contextlib.suppress(StoreUnavailable):
                await store.execute("GET", "x")
        assert time.monotonic() - started < 3.0  # failed fast: 50 calls waiting out a deadline would take far longer
        assert store.down
        redis_server.start()
        await wait_for(lambda: store.execute("PING"))
        assert await store.execute("GET", "x") is None  # a fresh server: no persistence
        assert not store.down
    finally:
        await store.aclose()


async def test_killed_connections_are_replaced(redis_server: RedisServer) -> None:
    store = Store(redis_server.url, cooldown_s=0.2)
    try:
        await store.execute("SET", "x", "1")
        with redis_server.client() as r:
            assert r.client_kill_filter(_type="normal") >= 1
        await wait_for(lambda: store.execute("GET", "x"))
        assert await store.execute("GET", "x") == b"1"
        assert store.failures <= 1
    finally:
        await store.aclose()


async def test_calls_queued_on_a_connection_that_is_killed_fail_at_once(redis_server: RedisServer) -> None:
    redis = client(redis_server.url, timeout_s=10.0, connections=1)
    try:
        assert await redis.call(("PING",)) == b"PONG"
        # A blocking command holds the connection's replies, so the GETs behind it (written in one burst, while
        # a reply is awaited) are still pending when the server drops the connection.
        blocked = asyncio.ensure_future(redis.call(("BLPOP", "never", 8)))
        gets = [asyncio.ensure_future(redis.call(("GET", f"k{i}"))) for i in range(50)]
        await asyncio.sleep(0.1)
        assert not any(g.done() for g in gets)
        started = time.monotonic()
        with redis_server.client() as r:
            assert r.client_kill_filter(_type="normal") >= 1
        results = await asyncio.gather(blocked, *gets, return_exceptions=True)
        assert time.monotonic() - started < 2.0  # the connection's loss, not the 10 s deadline
        assert all(isinstance(result, ConnectionError) for result in results)
        await wait_for(lambda: redis.call(("PING",)))  # a new connection serves again
    finally:
        await redis.aclose()


async def test_a_stopped_server_fails_calls_within_their_deadline_then_recovers(redis_server: RedisServer) -> None:
    store = Store(redis_server.url, timeout_s=0.1, cooldown_s=0.2)
    try:
        await store.execute("SET", "x", "1")
        redis_server.pause()
        try:
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await store.execute("GET", "x")
            assert time.monotonic() - started < 3.0  # its 100 ms deadline, not a hang
            assert not store.available
            assert store.down
            with pytest.raises(StoreUnavailable, match="circuit open"):
                await store.execute("GET", "x")
        finally:
            redis_server.resume()
        await wait_for(lambda: store.execute("PING"))
        assert await store.pipeline([("GET", "x"), ("INCR", "x")]) == [b"1", 2]
        assert not store.down
    finally:
        await store.aclose()


async def test_a_stalled_server_opens_the_decisions_breaker_only_once_silent(redis_server: RedisServer) -> None:
    """The store for decisions: a first late reply is slow, not down; silence past SILENT_S opens its breaker."""
    store = Store(redis_server.url).decisions(0.1)
    try:
        await store.execute("SET", "x", "1")
        redis_server.pause()
        try:
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match="late"):  # one late reply: slow, not yet down
                await store.execute("GET", "x")
            assert time.monotonic() - started < 3.0  # its deadline, not a hang
            assert store.available
            assert not store.down
            # Silent for longer than a slow server ever is: stalled, and the breaker opens.
            for _ in range(50):
                with contextlib.suppress(StoreUnavailable):
                    await store.execute("GET", "x")
                if store.down:
                    break
            assert store.down
            assert not store.available
            with pytest.raises(StoreUnavailable, match="circuit open"):
                await store.execute("GET", "x")
        finally:
            redis_server.resume()
        await wait_for(lambda: store.execute("PING"))
        assert await store.pipeline([("GET", "x"), ("INCR", "x")]) == [b"1", 2]
        assert not store.down
    finally:
        await store.aclose()


def answered_after_its_script(sync: redis.Redis) -> bool:
    """Whether the server answers a PING, as it does once its script is over: Redis holds the PING until then,
    Valkey 8 may answer BUSY meanwhile (polled: its script ends within a deadline)."""

    def answers() -> bool:
        try:
            return bool(sync.ping())
        except redis.ResponseError as exc:
            if str(exc).startswith("BUSY"):
                return False
            raise

    return wait_until(answers, timeout=10, interval=0.01, what="the server answering after its script")


async def test_a_slow_server_that_still_answers_never_opens_the_breaker(redis_server: RedisServer) -> None:
    """For the decisions' store, replies that miss their deadline while others keep coming back are a busy
    server, not a dead one; the request path's store takes the first as an outage, for its cool-down."""
    hasty = Store(redis_server.url, timeout_s=0.05, cooldown_s=5.0)
    await hasty.execute("SET", "x", "1")
    busy = asyncio.create_task(hasty.execute("EVAL", SPIN, 0, 120))
    await asyncio.sleep(0)  # let it be sent first
    with pytest.raises(StoreUnavailable):
        await busy
    assert hasty.down
    await hasty.aclose()
    with redis_server.client() as sync:
        assert answered_after_its_script(sync)
    origin = Store(redis_server.url, cooldown_s=5.0)
    store = origin.decisions(0.05)
    try:
        await store.execute("SET", "x", "1")
        with redis_server.client() as sync:
            for _ in range(5):
                # Redis runs a script for 120 ms: the call queued behind it misses its 50 ms deadline...
                busy = asyncio.create_task(store.execute("EVAL", SPIN, 0, 120))
                await asyncio.sleep(0)  # let it be sent first
                with pytest.raises(StoreUnavailable, match="late"):
                    await store.execute("GET", "x")
                with contextlib.suppress(StoreUnavailable):
                    await busy
                # ...and then the server answers again: nobody else is refused.
                assert answered_after_its_script(sync)
                assert await store.execute("GET", "x") == b"1"
                assert store.available
                assert not store.down
        assert store.late >= 5
        assert origin.failures == store.late  # counted where the Redis failure metric reads them
        assert store.failures == 0
    finally:
        await store.aclose()
        await origin.aclose()
        await origin.aclose()


async def test_a_flushed_script_is_sent_again(redis_server: RedisServer) -> None:
    store = Store(redis_server.url)
    script = Script("return {KEYS[1], ARGV[1]}")
    try:
        assert await store.run(script, ["k"], [7]) == [b"k", b"7"]
        await store.execute("SCRIPT", "FLUSH")
        assert await store.execute("SCRIPT", "EXISTS", script.sha) == [0]
        assert await store.run(script, ["k"], ["again"]) == [b"k", b"again"]
        assert await store.execute("SCRIPT", "EXISTS", script.sha) == [1]
        assert store.failures == 0
    finally:
        await store.aclose()


SCENARIOS = [test for name, test in list(globals().items()) if name.startswith("test_")]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda test: test.__name__.removeprefix("test_"))
def test_on_uvloop(scenario: Callable[[RedisServer], Coroutine[Any, Any, None]], redis_server: RedisServer) -> None:
    """Every scenario above again on uvloop, the loop the gateway serves on: its transports are not asyncio's."""
    uvloop = pytest.importorskip("uvloop")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario(redis_server))


async def test_rediss_verifies_the_server_certificate(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    tls_port = free_port()
    tls = ["--tls-port", str(tls_port), "--tls-auth-clients", "no"]
    tls += ["--tls-cert-file", str(tmp_path / "cert.pem"), "--tls-key-file", str(tmp_path / "key.pem")]
    try:
        server = RedisServer(*tls).__enter__()
    except (RuntimeError, OSError, redis.ConnectionError) as exc:
        pytest.skip(f"this redis-server has no TLS: {exc}")
    trusted = Store(f"rediss://localhost:{tls_port}/2?ssl_ca_certs={tmp_path / 'ca.pem'}")
    untrusted = Store(f"rediss://localhost:{tls_port}/2")
    try:
        assert await trusted.execute("SET", "over", "tls") == b"OK"
        with server.client() as r:
            r.execute_command("SELECT", 2)
            assert r.get("over") == b"tls"
        with pytest.raises(StoreUnavailable, match=r"(?i)certificate verify failed"):
            await untrusted.execute("PING")  # a certificate from an unknown CA is refused
    finally:
        await trusted.aclose()
        await untrusted.aclose()
        server.__exit__()
