"""The rate limiter's buckets, reservations, headers and 429s, on built Exchanges with a hand-driven clock."""

from __future__ import annotations

import math
import random
import re
from typing import Any, cast

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.config import parse
from gateway.context import Exchange
from gateway.errors import RateLimitError
from gateway.plugin import Outcome
from gateway.settings import ConfigError
from gateway.state.store import Store
from plugins.rate_limit import (
    INFLIGHT,
    PERIOD_MS,
    Lease,
    LocalBuckets,
    RateLimit,
    estimate,
    go_duration,
)
from tests.support.gateway import free_port
from tests.support.plugins import make, runtime

CONFIG = """
backends: {sim: {type: simulated}}
models:
  chat-large: {backend: sim}
  chat-small: {backend: sim}
  embed: {backend: sim}
rate_limit: {default_max_tokens: 100}
auth: {required: false}
plugins: [auth, rate_limit]
tenants:
  acme: {rate_limit: {requests_per_minute: 3}}
  tokenco: {rate_limit: {tokens_per_minute: 2000}}
  both: {rate_limit: {requests_per_minute: 100, tokens_per_minute: 1000}}
  permodel: {rate_limit: {requests_per_minute: 100, models: {chat-large: {requests_per_minute: 2}}}}
  modelonly: {rate_limit: {models: {chat-small: {tokens_per_minute: 500}}}}
  free: {}
"""


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def exchange(tenant: str, model: str = "chat-small", endpoint: str = "chat/completions", **fields: Any) -> Exchange:
    payload: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}
    body = orjson.dumps(payload)
    ex = Exchange("req-1", endpoint, [], body, payload, 0.0)
    ex.tenant = tenant
    return ex


async def limiter(clock: Clock, config: str = CONFIG) -> RateLimit:
    plugin = make(RateLimit, parse(config), clock=clock)
    await plugin.startup(runtime())
    return plugin


async def admit(plugin: RateLimit, ex: Exchange) -> None:
    """on_request as the pipeline runs it: a plain method whose answer is awaited only when it is a coroutine
    (the leases lacked room)."""
    answered = plugin.on_request(ex)
    if answered is not None:
        await answered


async def headers_of(plugin: RateLimit, ex: Exchange) -> dict[str, str]:
    """The headers its on_request gave the response (the pipeline adds them to the head)."""
    return {k.decode(): v.decode() for k, v in ex.response_headers or []}


async def refused(plugin: RateLimit, ex: Exchange) -> RateLimitError:
    with pytest.raises(RateLimitError) as caught:
        await admit(plugin, ex)
    return caught.value


# The bucket


def test_bucket_admits_the_limit_then_refuses() -> None:
    clock = Clock()
    buckets = LocalBuckets(clock)
    args = [0, 3, PERIOD_MS, 1]
    results = [buckets.take(["k"], args) for _ in range(3)]
    assert [r[0] for r in results] == [1, 1, 1]
    assert [r[1] for r in results] == [2, 1, 0]  # remaining
    assert [r[2] for r in results] == [20_000, 40_000, 60_000]  # ms until full again
    refusal = buckets.take(["k"], args)
    assert refusal[0] == 0
    assert refusal[1:] == [0, 60_000, 20_000]  # nothing taken; one request fits again in 20 s


def test_bucket_refills_smoothly_with_the_clock() -> None:
    clock = Clock()
    buckets = LocalBuckets(clock)
    args = [0, 3, PERIOD_MS, 1]
    for _ in range(3):
        buckets.take(["k"], args)
    clock.now += 19.9
    assert buckets.take(["k"], args)[0] == 0
    clock.now += 0.1
    assert buckets.take(["k"], args)[0] == 1  # 20 s refill one request (limit / 60 per second)
    clock.now += 600
    assert buckets.take(["k"], args)[:3] == [1, 2, 20_000]  # never above capacity however long idle


def test_bucket_is_all_or_nothing() -> None:
    clock = Clock()
    buckets = LocalBuckets(clock)
    buckets.take(["tokens"], [0, 1000, PERIOD_MS, 900])
    verdict = buckets.take(["requests", "tokens"], [0, 10, PERIOD_MS, 1, 1000, PERIOD_MS, 200])
    assert verdict[0] == 0
    assert verdict[1] == 10  # the requests bucket fits, but is not charged since tokens do not
    assert verdict[3] == 0
    assert verdict[6] == 6_000  # 100 missing tokens at 1000 per minute
    assert buckets.take(["requests"], [0, 10, PERIOD_MS, 1])[1] == 9


def test_forced_charges_and_refunds() -> None:
    clock = Clock()
    buckets = LocalBuckets(clock)
    buckets.take(["t"], [0, 1000, PERIOD_MS, 600])
    assert buckets.take(["t"], [1, 1000, PERIOD_MS, -500])[1] == 900
    assert buckets.take(["t"], [1, 1000, PERIOD_MS, -5000])[1] == 1000  # a refund never overfills
    assert "t" not in buckets.full_at
    debt = buckets.take(["t"], [1, 1000, PERIOD_MS, 1500])
    assert debt[0] == 1
    assert debt[1] == -500
    assert debt[2] == 90_000  # usage beyond the limit is owed


# The plugin


async def test_unlimited_tenants_cost_nothing() -> None:
    plugin = await limiter(Clock())
    for tenant in ("free", "anonymous", "nobody"):
        ex = exchange(tenant)
        for _ in range(10):
            assert plugin.on_request(ex) is None  # in process: answered without a coroutine
        assert ex.state == {INFLIGHT: tenant}  # counted in flight, and nothing reserved
        assert await headers_of(plugin, ex) == {}
    assert ("modelonly", "chat-large") not in plugin.plans  # a limit on another model only


async def test_requests_limit_and_headers() -> None:
    plugin = await limiter(Clock())
    remaining = []
    for _ in range(3):
        ex = exchange("acme")
        await admit(plugin, ex)
        headers = await headers_of(plugin, ex)
        assert headers["x-ratelimit-limit-requests"] == "3"
        assert "x-ratelimit-limit-tokens" not in headers
        remaining.append(headers["x-ratelimit-remaining-requests"])
        assert headers["x-ratelimit-reset-requests"] == go_duration(20_000 * (3 - int(remaining[-1])))
    assert remaining == ["2", "1", "0"]
    error = await refused(plugin, exchange("acme"))
    assert error.status == 429
    payload = orjson.loads(error.body())
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["type"] == "requests"
    assert payload["error"]["code"] == "rate_limit_exceeded"
    assert payload["error"]["param"] is None
    assert payload["error"]["message"] == (
        "Rate limit reached for tenant acme on requests per min (RPM): Limit 3, Used 3, Requested 1. "
        "Please try again in 20s."
    )
    headers = {k.decode(): v.decode() for k, v in error.headers}
    assert headers["retry-after"] == "20"
    assert headers["retry-after-ms"] == "20000"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"] == "1m0s"


async def test_retry_after_is_whole_seconds_rounded_up_and_at_least_one() -> None:
    clock = Clock()
    plugin = await limiter(clock)
    for _ in range(3):
        await admit(plugin, exchange("acme"))
    clock.now += 19.5
    headers = dict((await refused(plugin, exchange("acme"))).headers)
    assert headers[b"retry-after"] == b"1"
    assert headers[b"retry-after-ms"] == b"500"
    clock.now += 0.4
    headers = dict((await refused(plugin, exchange("acme"))).headers)
    assert headers[b"retry-after"] == b"1"
    assert headers[b"retry-after-ms"] == b"100"


async def test_tokens_are_reserved_and_corrected_from_usage() -> None:
    plugin = await limiter(Clock())
    first = exchange("tokenco", max_tokens=1000)
    reserved, completion = estimate(first, 100)
    assert completion == 1000
    assert reserved == 1000 + len(first.body) // 4
    await admit(plugin, first)
    headers = await headers_of(plugin, first)
    assert headers["x-ratelimit-limit-tokens"] == "2000"
    assert int(headers["x-ratelimit-remaining-tokens"]) == 2000 - reserved
    # Without a correction the same request does not fit again.
    error = await refused(plugin, exchange("tokenco", max_tokens=1000))
    assert orjson.loads(error.body())["error"]["type"] == "tokens"
    assert f"Limit 2000, Used {reserved}, Requested {reserved}." in error.message
    plugin.on_complete(first, Outcome(200, complete=True, usage={"total_tokens": 12}))
    second = exchange("tokenco", max_tokens=1000)
    await admit(plugin, second)
    assert int((await headers_of(plugin, second))["x-ratelimit-remaining-tokens"]) == 2000 - 12 - reserved


async def test_failed_request_refunds_the_completion_part() -> None:
    plugin = await limiter(Clock())
    failed = exchange("tokenco", max_tokens=1500)
    await admit(plugin, failed)
    plugin.on_complete(failed, Outcome(502, error="upstream failed"))
    probe = exchange("tokenco", max_tokens=1)
    await admit(plugin, probe)
    charged = len(failed.body) // 4 + estimate(probe, 100)[0]
    assert int((await headers_of(plugin, probe))["x-ratelimit-remaining-tokens"]) == 2000 - charged


async def test_completed_stream_without_usage_keeps_its_reservation() -> None:
    plugin = await limiter(Clock())
    streamed = exchange("tokenco", max_tokens=1500, stream=True)
    await admit(plugin, streamed)
    plugin.on_complete(streamed, Outcome(200, complete=True))
    await refused(plugin, exchange("tokenco", max_tokens=1000))


async def test_an_answer_from_a_plugin_costs_no_tokens() -> None:
    plugin = await limiter(Clock())
    cached = exchange("tokenco", max_tokens=1500)
    await admit(plugin, cached)
    plugin.on_complete(cached, Outcome(200, complete=True, source="cache"))
    probe = exchange("tokenco", max_tokens=1)
    await admit(plugin, probe)
    assert int((await headers_of(plugin, probe))["x-ratelimit-remaining-tokens"]) == 2000 - estimate(probe, 100)[0]


async def test_usage_above_the_reservation_is_charged() -> None:
    clock = Clock()
    plugin = await limiter(clock)
    ex = exchange("tokenco", max_tokens=10)
    await admit(plugin, ex)
    plugin.on_complete(ex, Outcome(200, complete=True, usage={"total_tokens": 2500}))
    error = await refused(plugin, exchange("tokenco", max_tokens=1))
    assert "Used 2500" in error.message
    clock.now += 16  # 500 tokens owed, then the request's own: 16 s at 2000 per minute is enough
    await admit(plugin, exchange("tokenco", max_tokens=1))


async def test_a_reservation_larger_than_the_limit_waits_for_a_full_bucket() -> None:
    clock = Clock()
    plugin = await limiter(clock)
    big = exchange("tokenco", max_tokens=5000)
    await admit(plugin, big)  # capped at the capacity: admitted on a full bucket, never stuck
    assert (await headers_of(plugin, big))["x-ratelimit-remaining-tokens"] == "0"
    error = await refused(plugin, exchange("tokenco", max_tokens=5000))
    assert dict(error.headers)[b"retry-after"] == b"60"
    plugin.on_complete(big, Outcome(200, complete=True, usage={"total_tokens": 100}))
    await admit(plugin, exchange("tokenco", max_tokens=5))


async def test_requests_and_tokens_are_checked_together() -> None:
    plugin = await limiter(Clock())
    await admit(plugin, exchange("both", max_tokens=900))
    error = await refused(plugin, exchange("both", max_tokens=900))
    assert error.type == "tokens"
    ex = exchange("both", max_tokens=1)
    await admit(plugin, ex)
    headers = await headers_of(plugin, ex)
    assert headers["x-ratelimit-remaining-requests"] == "98"  # the refused request took no request either
    assert headers["x-ratelimit-limit-tokens"] == "1000"


async def test_per_model_limits_add_to_the_tenant_limits() -> None:
    plugin = await limiter(Clock())
    for _ in range(2):
        await admit(plugin, exchange("permodel", "chat-large"))
    error = await refused(plugin, exchange("permodel", "chat-large"))
    assert error.message.startswith("Rate limit reached for chat-large in tenant permodel on requests per min")
    ex = exchange("permodel", "chat-small")
    await admit(plugin, ex)  # the tenant-wide bucket still has room
    headers = await headers_of(plugin, ex)
    assert headers["x-ratelimit-limit-requests"] == "100"
    assert headers["x-ratelimit-remaining-requests"] == "97"
    # Where both apply, the headers show the tighter one.
    large = exchange("permodel", "chat-large")
    plugin.local.full_at.clear()
    await admit(plugin, large)
    assert (await headers_of(plugin, large))["x-ratelimit-limit-requests"] == "2"


async def test_model_only_limits() -> None:
    plugin = await limiter(Clock())
    ex = exchange("modelonly", "chat-small", max_tokens=400)
    await admit(plugin, ex)
    assert (await headers_of(plugin, ex))["x-ratelimit-limit-tokens"] == "500"
    assert await headers_of(plugin, exchange("modelonly", "chat-large")) == {}


def test_estimate() -> None:
    chat = exchange("t")
    assert estimate(chat, 100) == (len(chat.body) // 4 + 100, 100)
    both = exchange("t", max_tokens=10, max_completion_tokens=20)
    assert estimate(both, 100)[1] == 20
    assert estimate(exchange("t", max_tokens=10, n=3), 100)[1] == 30
    assert estimate(exchange("t", max_tokens="lots"), 100)[1] == 100
    assert estimate(exchange("t", max_tokens=0), 100)[1] == 100
    embedding = exchange("t", "embed", "embeddings", input="hello")
    assert estimate(embedding, 100) == (len(embedding.body) // 4, 0)


def test_a_limit_for_an_unknown_model_is_a_config_error() -> None:
    config = CONFIG + "  typo: {rate_limit: {models: {chat-lrage: {requests_per_minute: 1}}}}\n"
    with pytest.raises(ConfigError, match=r"tenants\.typo\.rate_limit\.models\.chat-lrage: no model named"):
        parse(config)


async def test_redis_unreachable_fails_open_to_the_process() -> None:
    store = Store(f"redis://127.0.0.1:{free_port()}/0")
    plugin = make(RateLimit, parse(CONFIG))
    try:
        await plugin.startup(runtime(store))
        for _ in range(3):
            await admit(plugin, exchange("acme"))
        await refused(plugin, exchange("acme"))  # the process still limits
    finally:
        await store.aclose()
    assert plugin.fallbacks == 4
    assert store.failures >= 1


# Leases: the arithmetic of one process's share of a shared bucket (times in ms)


def test_a_lease_is_sized_to_the_observed_rate_within_its_cap() -> None:
    lease = Lease(limit=600_000, cap=3000, ttl_ms=1000)
    lease.need = 1
    assert lease.outgoing(0.0, renew=True) == (0, 1, 1)  # nothing observed yet: what the request needs
    lease.granted(0.0, 1, 6)
    for _ in range(100):  # 100 requests in 100 ms: 1 per ms, so 200 for the next 200 ms
        lease.free += 1
        lease.take(1)
    assert lease.low == 0
    assert lease.outgoing(100.0, renew=True) is None  # not known to be busy: no renewal
    lease.free = 0
    lease.need = 1
    assert lease.outgoing(101.0, renew=True) == (0, 200, 1)
    lease.granted(101.0, 200, 0)
    assert lease.low == 100  # busy: renewed in the background once half is gone
    for _ in range(2000):  # 20 per ms: capped
        lease.take(1)
    lease.free = 0
    assert lease.outgoing(201.0, renew=True) == (0, 3000, 0)
    lease.granted(201.0, 0, 0)
    lease.free = 0
    # Idle for 3 s: the rate is forgotten, the lease shrinks, and so slow a process renews nothing ahead.
    lease.need = 1
    settle, want, need = cast("tuple[int, int, int]", lease.outgoing(3201.0, renew=True))
    assert (settle, need) == (0, 1)
    assert want == round(20 * math.exp(-3) * 200)
    lease.rate = lease.hit_rate = 0.0
    lease.granted(3201.0, want, 0)
    assert lease.low == 0


def test_a_waiting_request_takes_what_it_needs_even_beyond_the_cap() -> None:
    lease = Lease(limit=10_000, cap=50, ttl_ms=1000)
    lease.granted(0.0, 20, 120)
    lease.need = 1200 - 20
    assert lease.outgoing(0.0, renew=False) == (0, 1180, 1180)
    assert lease.outgoing(1.0, renew=False) is None  # the need was sent once; nothing else to say


def test_corrections_and_lapsed_units_go_back_with_the_next_sync() -> None:
    lease = Lease(limit=1000, cap=100, ttl_ms=1000)
    lease.granted(0.0, 40, 60_000 * 100 // 1000)  # 40 granted, the bucket 100 below full after them
    lease.take(30)
    lease.settle += -25  # a reservation of 30 that used 5
    assert lease.outgoing(500.0, renew=False) == (-25, 0, 0)  # not lapsed yet: the 10 left stay here
    assert lease.free == 10
    lease.owe(7)  # admitted on credit while a sync was late
    assert lease.outgoing(1000.0, renew=False) == (7 - 10, 0, 0)  # lapsed: the 10 go back, the 7 are charged
    assert lease.free == 0
    assert lease.settle == 0
    assert lease.outgoing(2000.0, renew=False) is None


def test_what_a_lease_knows_of_the_shared_bucket() -> None:
    lease = Lease(limit=600, cap=3, ttl_ms=1000)  # 10 per second come back
    assert lease.known(0.0) == 600  # a missing key is a full bucket
    assert not lease.fresh(0.0)  # never synced
    lease.granted(0.0, 3, 59_700)  # the shared bucket was left with 600 - 597 = 3 beside these 3
    assert lease.known(0.0) == pytest.approx(6)
    lease.take(2)
    assert lease.remaining(0.0) == 4
    assert lease.full_in(4) == 59_600
    assert lease.known(500.0) == pytest.approx(9)  # plus what came back since
    lease.settle = 5  # owed: corrections charge later
    assert lease.remaining(500.0) == 4
    assert lease.report(500.0) == (4, lease.full_in(4), 0)
    assert lease.wait(500.0, 10) == 600  # 6 missing, 10 a second
    assert lease.fresh(999.0)
    assert not lease.fresh(1000.0)
    # A sync fails at 900 ms, with the store tried again 1 s later: what was known stays, and stays the basis
    # of decisions until then, past its usual lifetime.
    lease.failed(900.0, 1000.0)
    assert (lease.free, lease.settle) == (1, 5)
    assert lease.known(900.0) == pytest.approx(8)
    assert lease.fresh(1899.0)
    assert not lease.fresh(1900.0)
    lease.failed(1900.0, 1000.0)  # stale by then: not extended again, the in-process buckets decide
    assert not lease.fresh(1901.0)


def test_the_over_admission_bound_holds_for_four_processes() -> None:
    """Four processes admitting from leases of one bucket, which grants like the Redis script: over a minute
    and a half they admit at most what a token bucket does plus what the leases can hold (docs/rate-limits.md)."""
    limit, processes, share = 6000, 4, 0.005
    cap = max(1, math.floor(share * limit))
    per_ms = limit / PERIOD_MS
    level, now, admitted = float(limit), 0.0, 0
    leases = [Lease(limit, cap, 1000.0) for _ in range(processes)]
    rng = random.Random(7)

    def sync(lease: Lease, renew: bool) -> None:
        nonlocal level
        out = lease.outgoing(now, renew)
        if out is None:
            return
        settle, want, need = out
        level = min(float(limit), level - settle)
        grant = max(0, min(want, math.floor(level)))
        grant = grant if grant >= need else 0
        level -= grant
        lease.granted(now, grant, math.ceil((limit - level) / per_ms))

    while now < 90_000:
        step = rng.expovariate(1.0)  # about 1000 requests a second offered: far beyond the limit
        now += step
        level = min(float(limit), level + per_ms * step)
        lease = rng.choice(leases)
        for other in leases:
            if other.free and now >= other.expires:
                sync(other, renew=False)
        if lease.free < 1:
            lease.need = 1
            sync(lease, renew=True)
        if lease.free >= 1:
            lease.take(1)
            admitted += 1
            if lease.free < lease.low:
                sync(lease, renew=True)
    bucket = limit + per_ms * now  # a token bucket's most in that time
    assert bucket - processes * cap <= admitted <= bucket + processes * cap
    assert max(lease.free for lease in leases) <= cap


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "0s"),
        (-5, "0s"),
        (1, "1ms"),
        (120, "120ms"),
        (999, "999ms"),
        (1000, "1s"),
        (1500, "1.5s"),
        (6000, "6s"),
        (6250, "6.25s"),
        (59_999, "59.999s"),
        (60_000, "1m0s"),
        (61_500, "1m1.5s"),
        (3_600_000, "1h0m0s"),
        (3_723_004, "1h2m3.004s"),
    ],
)
def test_go_duration(ms: int, text: str) -> None:
    assert go_duration(ms) == text
    assert re.fullmatch(r"(\d+h)?(\d+m)?(\d+(\.\d+)?s|\d+ms)", text)


@given(
    st.integers(1, 10**9),
    st.floats(0, 120_000),
    st.floats(0, 120_000),
    st.integers(0, 10**6),
    st.integers(-(10**6), 10**6),
)
def test_a_leases_report_is_its_remaining_and_full_in(
    limit: int, full_ms: float, later: float, free: int, owed: int
) -> None:
    lease = Lease(limit=limit, cap=limit, ttl_ms=1000)
    lease.granted(0.0, 0, round(full_ms))
    lease.free, lease.settle = free, owed
    remaining = lease.remaining(later)
    assert lease.report(later) == (remaining, lease.full_in(remaining), 0)


async def test_requests_in_flight_are_capped_per_tenant() -> None:
    plugin = await limiter(Clock())
    assert plugin.concurrency.default == 512  # half of pool.max_connections (1024)
    plugin.concurrency.default = 2
    first, second = exchange("free"), exchange("free")
    await admit(plugin, first)
    await admit(plugin, second)
    with pytest.raises(RateLimitError) as caught:
        await admit(plugin, exchange("free"))
    assert caught.value.code == "concurrency_limit"
    assert caught.value.status == 429
    assert (b"retry-after", b"1") in caught.value.headers
    await admit(plugin, exchange("anonymous"))  # another tenant is not affected
    plugin.on_complete(first, Outcome(status=200, complete=True))
    await admit(plugin, exchange("free"))  # one ended: room for one more
    assert plugin.concurrency.inflight == {"free": 2, "anonymous": 1}
