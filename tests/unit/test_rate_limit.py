"""The rate limiter's buckets, reservations, headers and 429s, on built Exchanges with a hand-driven clock."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest

from gateway.config import parse
from gateway.context import Exchange
from gateway.errors import RateLimitError
from gateway.plugin import Outcome, ResponseHead
from gateway.settings import ConfigError
from gateway.store import Store
from plugins.rate_limit import (
    PERIOD_MS,
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


async def headers_of(plugin: RateLimit, ex: Exchange) -> dict[str, str]:
    head = ResponseHead(200, [])
    await plugin.on_response(ex, head)
    return {k.decode(): v.decode() for k, v in head.headers}


async def refused(plugin: RateLimit, ex: Exchange) -> RateLimitError:
    with pytest.raises(RateLimitError) as caught:
        await plugin.on_request(ex)
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
    assert verdict[3] == 0 and verdict[6] == 6_000  # 100 missing tokens at 1000 per minute
    assert buckets.take(["requests"], [0, 10, PERIOD_MS, 1])[1] == 9


def test_forced_charges_and_refunds() -> None:
    clock = Clock()
    buckets = LocalBuckets(clock)
    buckets.take(["t"], [0, 1000, PERIOD_MS, 600])
    assert buckets.take(["t"], [1, 1000, PERIOD_MS, -500])[1] == 900
    assert buckets.take(["t"], [1, 1000, PERIOD_MS, -5000])[1] == 1000  # a refund never overfills
    assert "t" not in buckets.full_at
    debt = buckets.take(["t"], [1, 1000, PERIOD_MS, 1500])
    assert debt[0] == 1 and debt[1] == -500 and debt[2] == 90_000  # usage beyond the limit is owed


# The plugin


async def test_unlimited_tenants_cost_nothing() -> None:
    plugin = await limiter(Clock())
    for tenant in ("free", "anonymous", "nobody"):
        ex = exchange(tenant)
        for _ in range(10):
            assert await plugin.on_request(ex) is None  # type: ignore[func-returns-value]
        assert ex.state == {}
        assert await headers_of(plugin, ex) == {}
    assert ("modelonly", "chat-large") not in plugin.plans  # a limit on another model only


async def test_requests_limit_and_headers() -> None:
    plugin = await limiter(Clock())
    remaining = []
    for _ in range(3):
        ex = exchange("acme")
        await plugin.on_request(ex)
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
        await plugin.on_request(exchange("acme"))
    clock.now += 19.5
    headers = dict((await refused(plugin, exchange("acme"))).headers)
    assert headers[b"retry-after"] == b"1"
    assert headers[b"retry-after-ms"] == b"500"
    clock.now += 0.4
    headers = dict((await refused(plugin, exchange("acme"))).headers)
    assert headers[b"retry-after"] == b"1" and headers[b"retry-after-ms"] == b"100"


async def test_tokens_are_reserved_and_corrected_from_usage() -> None:
    plugin = await limiter(Clock())
    first = exchange("tokenco", max_tokens=1000)
    reserved, completion = estimate(first, 100)
    assert completion == 1000 and reserved == 1000 + len(first.body) // 4
    await plugin.on_request(first)
    headers = await headers_of(plugin, first)
    assert headers["x-ratelimit-limit-tokens"] == "2000"
    assert int(headers["x-ratelimit-remaining-tokens"]) == 2000 - reserved
    # Without a correction the same request does not fit again.
    error = await refused(plugin, exchange("tokenco", max_tokens=1000))
    assert orjson.loads(error.body())["error"]["type"] == "tokens"
    assert f"Limit 2000, Used {reserved}, Requested {reserved}." in error.message
    await plugin.on_complete(first, Outcome(200, complete=True, usage={"total_tokens": 12}))
    second = exchange("tokenco", max_tokens=1000)
    await plugin.on_request(second)
    assert int((await headers_of(plugin, second))["x-ratelimit-remaining-tokens"]) == 2000 - 12 - reserved


async def test_failed_request_refunds_the_completion_part() -> None:
    plugin = await limiter(Clock())
    failed = exchange("tokenco", max_tokens=1500)
    await plugin.on_request(failed)
    await plugin.on_complete(failed, Outcome(502, error="upstream failed"))
    probe = exchange("tokenco", max_tokens=1)
    await plugin.on_request(probe)
    charged = len(failed.body) // 4 + estimate(probe, 100)[0]
    assert int((await headers_of(plugin, probe))["x-ratelimit-remaining-tokens"]) == 2000 - charged


async def test_completed_stream_without_usage_keeps_its_reservation() -> None:
    plugin = await limiter(Clock())
    streamed = exchange("tokenco", max_tokens=1500, stream=True)
    await plugin.on_request(streamed)
    await plugin.on_complete(streamed, Outcome(200, complete=True))
    await refused(plugin, exchange("tokenco", max_tokens=1000))


async def test_an_answer_from_a_plugin_costs_no_tokens() -> None:
    plugin = await limiter(Clock())
    cached = exchange("tokenco", max_tokens=1500)
    await plugin.on_request(cached)
    await plugin.on_complete(cached, Outcome(200, complete=True, source="cache"))
    probe = exchange("tokenco", max_tokens=1)
    await plugin.on_request(probe)
    assert int((await headers_of(plugin, probe))["x-ratelimit-remaining-tokens"]) == 2000 - estimate(probe, 100)[0]


async def test_usage_above_the_reservation_is_charged() -> None:
    clock = Clock()
    plugin = await limiter(clock)
    ex = exchange("tokenco", max_tokens=10)
    await plugin.on_request(ex)
    await plugin.on_complete(ex, Outcome(200, complete=True, usage={"total_tokens": 2500}))
    error = await refused(plugin, exchange("tokenco", max_tokens=1))
    assert "Used 2500" in error.message
    clock.now += 16  # 500 tokens owed, then the request's own: 16 s at 2000 per minute is enough
    await plugin.on_request(exchange("tokenco", max_tokens=1))


async def test_a_reservation_larger_than_the_limit_waits_for_a_full_bucket() -> None:
    clock = Clock()
    plugin = await limiter(clock)
    big = exchange("tokenco", max_tokens=5000)
    await plugin.on_request(big)  # capped at the capacity: admitted on a full bucket, never stuck
    assert (await headers_of(plugin, big))["x-ratelimit-remaining-tokens"] == "0"
    error = await refused(plugin, exchange("tokenco", max_tokens=5000))
    assert dict(error.headers)[b"retry-after"] == b"60"
    await plugin.on_complete(big, Outcome(200, complete=True, usage={"total_tokens": 100}))
    await plugin.on_request(exchange("tokenco", max_tokens=5))


async def test_requests_and_tokens_are_checked_together() -> None:
    plugin = await limiter(Clock())
    await plugin.on_request(exchange("both", max_tokens=900))
    error = await refused(plugin, exchange("both", max_tokens=900))
    assert error.type == "tokens"
    ex = exchange("both", max_tokens=1)
    await plugin.on_request(ex)
    headers = await headers_of(plugin, ex)
    assert headers["x-ratelimit-remaining-requests"] == "98"  # the refused request took no request either
    assert headers["x-ratelimit-limit-tokens"] == "1000"


async def test_per_model_limits_add_to_the_tenant_limits() -> None:
    plugin = await limiter(Clock())
    for _ in range(2):
        await plugin.on_request(exchange("permodel", "chat-large"))
    error = await refused(plugin, exchange("permodel", "chat-large"))
    assert error.message.startswith("Rate limit reached for chat-large in tenant permodel on requests per min")
    ex = exchange("permodel", "chat-small")
    await plugin.on_request(ex)  # the tenant-wide bucket still has room
    headers = await headers_of(plugin, ex)
    assert headers["x-ratelimit-limit-requests"] == "100"
    assert headers["x-ratelimit-remaining-requests"] == "97"
    # Where both apply, the headers show the tighter one.
    large = exchange("permodel", "chat-large")
    plugin.local.full_at.clear()
    await plugin.on_request(large)
    assert (await headers_of(plugin, large))["x-ratelimit-limit-requests"] == "2"


async def test_model_only_limits() -> None:
    plugin = await limiter(Clock())
    ex = exchange("modelonly", "chat-small", max_tokens=400)
    await plugin.on_request(ex)
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
            await plugin.on_request(exchange("acme"))
        await refused(plugin, exchange("acme"))  # the process still limits
    finally:
        await store.aclose()
    assert plugin.fallbacks == 4
    assert store.failures >= 1


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
