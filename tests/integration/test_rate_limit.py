"""Rate limits on real gateways sharing a real redis-server, seen through httpx and the openai SDK."""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.store import Store
from plugins.rate_limit import PERIOD_MS, SCRIPT, LocalBuckets
from tests.support.gateway import RunningGateway, gateway_process, gateway_thread
from tests.support.redis import RedisServer

KEY = "sk-sluice-acme-test-key"
MESSAGES = [{"role": "user", "content": "hi"}]
GO_DURATION = re.compile(r"(\d+h)?(\d+m)?(\d+(\.\d+)?s|\d+ms)")


def config(redis_url: str, limits: str) -> str:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    return f"""
backends: {{sim: {{type: simulated, ttft_ms: 0, tpot_ms: 0, tokens: 5}}}}
models: {{chat: {{backend: sim}}}}
tenants:
  acme: {{keys: ["sha256:{digest}"], rate_limit: {limits}}}
redis: {{url: "{redis_url}"}}
auth: {{required: true}}
plugins: [auth, rate_limit]
"""


@pytest.fixture()
def http() -> Iterator[httpx.Client]:
    with httpx.Client(headers={"authorization": f"Bearer {KEY}"}, timeout=5.0) as client:
        yield client


def chat(http: httpx.Client, gw: RunningGateway, **fields: Any) -> httpx.Response:
    return http.post(f"{gw.base_url}/chat/completions", json={"model": "chat", "messages": MESSAGES, **fields})


def sdk(gw: RunningGateway, max_retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=KEY, max_retries=max_retries)


def two_gateways(stack: ExitStack, yaml: str, tmp_path: Path) -> tuple[RunningGateway, RunningGateway]:
    return stack.enter_context(gateway_process(yaml, tmp_path)), stack.enter_context(gateway_process(yaml, tmp_path))


def test_requests_limit_is_shared_by_two_processes(
    redis_server: RedisServer, tmp_path: Path, http: httpx.Client
) -> None:
    yaml = config(redis_server.url, "{requests_per_minute: 10}")
    with ExitStack() as stack:
        gateways = two_gateways(stack, yaml, tmp_path)
        remaining = []
        for i in range(10):
            response = chat(http, gateways[i % 2])
            assert response.status_code == 200, response.text
            assert response.headers["x-ratelimit-limit-requests"] == "10"
            assert GO_DURATION.fullmatch(response.headers["x-ratelimit-reset-requests"])
            assert "x-ratelimit-limit-tokens" not in response.headers
            remaining.append(int(response.headers["x-ratelimit-remaining-requests"]))
        assert remaining == list(range(9, -1, -1))  # one bucket for both processes

        refused = chat(http, gateways[0])
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert refused.json()["error"]["type"] == "requests"
        assert 1 <= int(refused.headers["retry-after"]) <= 6
        assert 0 < int(refused.headers["retry-after-ms"]) <= 6000
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert refused.headers["x-ratelimit-limit-requests"] == "10"

        with pytest.raises(openai.RateLimitError) as caught:
            sdk(gateways[1]).chat.completions.create(model="chat", messages=MESSAGES)  # type: ignore[arg-type]
        assert caught.value.status_code == 429
        assert caught.value.code == "rate_limit_exceeded"
        assert caught.value.type == "requests"
        assert "Rate limit reached for tenant acme on requests per min (RPM): Limit 10, Used 10" in str(caught.value)


def test_sdk_retries_after_retry_after(redis_server: RedisServer, http: httpx.Client) -> None:
    # 30 per minute: once drained, the next request fits again about 2 s later, far beyond the SDK's own
    # first back-off (0.5 s), so the retry succeeds only if the SDK waited for what the gateway said.
    with gateway_thread(config(redis_server.url, "{requests_per_minute: 30}")) as gw:
        for _ in range(30):
            assert chat(http, gw).status_code == 200
        probe = chat(http, gw)
        assert probe.status_code == 429
        wait_s = int(probe.headers["retry-after-ms"]) / 1000
        assert wait_s > 1.0
        started = time.monotonic()
        raw = sdk(gw, max_retries=1).chat.completions.with_raw_response.create(model="chat", messages=MESSAGES)  # type: ignore[arg-type]
        elapsed = time.monotonic() - started
        assert raw.http_response.status_code == 200
        assert raw.retries_taken == 1  # the gateway saw two attempts: the 429, then the retry
        assert elapsed >= wait_s - 0.1
        assert raw.headers["x-ratelimit-remaining-requests"] == "0"


def test_tokens_reservation_and_usage_refund(redis_server: RedisServer, http: httpx.Client) -> None:
    with gateway_thread(config(redis_server.url, "{tokens_per_minute: 2000}")) as gw:
        first = chat(http, gw, max_tokens=1000)
        assert first.status_code == 200, first.text
        assert first.headers["x-ratelimit-limit-tokens"] == "2000"
        left = int(first.headers["x-ratelimit-remaining-tokens"])
        assert 900 < left < 1000  # 1000 for the answer plus the prompt estimate
        assert first.json()["usage"]["total_tokens"] < 20
        time.sleep(0.2)  # the correction runs right after the last byte
        # Without the refund this reservation (> 1000) would not fit in what was left (< 1000 + 7 refilled).
        second = chat(http, gw, max_tokens=1000)
        assert second.status_code == 200, second.text
        # The first request now costs its usage (< 20) only, the second its whole reservation.
        assert left - 20 <= int(second.headers["x-ratelimit-remaining-tokens"]) < left + 10
        time.sleep(0.2)
        # A stream whose client did not ask for usage is corrected too: the gateway asks the upstream for it.
        with http.stream(
            "POST", f"{gw.base_url}/chat/completions",
            json={"model": "chat", "messages": MESSAGES, "max_tokens": 1500, "stream": True},
        ) as streamed:  # fmt: skip
            assert streamed.status_code == 200
            assert b'"usage"' not in streamed.read()
        time.sleep(0.2)
        assert chat(http, gw, max_tokens=1000).status_code == 200  # would not fit had the stream kept 1500
        time.sleep(0.2)
        # A reservation larger than the bucket waits for a full one: refused while tokens are still in use.
        with pytest.raises(openai.RateLimitError) as caught:
            sdk(gw).chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1995)  # type: ignore[arg-type]
        assert caught.value.code == "rate_limit_exceeded"
        assert caught.value.type == "tokens"
        assert "on tokens per min (TPM): Limit 2000" in str(caught.value)
        headers = caught.value.response.headers
        assert int(headers["x-ratelimit-remaining-tokens"]) < 2000
        assert int(headers["retry-after"]) >= 1
        # A small request still fits: the refusal took nothing.
        assert chat(http, gw, max_tokens=5).status_code == 200


def test_redis_outage_fails_open_then_sharing_resumes(
    redis_server: RedisServer, tmp_path: Path, http: httpx.Client
) -> None:
    yaml = config(redis_server.url, "{requests_per_minute: 6}")

    def timed(gw: RunningGateway) -> int:
        started = time.monotonic()
        status = chat(http, gw).status_code
        assert time.monotonic() - started < 0.5  # no hang on a dead store
        return status

    with ExitStack() as stack:
        a, b = two_gateways(stack, yaml, tmp_path)
        assert [timed(gw) for gw in (a, b, a, b, a, b)] == [200] * 6
        assert [timed(a), timed(b)] == [429, 429]

        redis_server.stop()
        # Fail open to per-process buckets: each process now admits its own 6.
        for gw in (a, b):
            assert [timed(gw) for _ in range(6)] == [200] * 6
            assert timed(gw) == 429

        redis_server.start()  # empty: the script and the buckets are gone
        time.sleep(1.2)  # the store's breaker stays open for a second after the last failure
        # Shared again: the drained per-process buckets would refuse at once; Redis admits 6 in total.
        assert [timed(gw) for gw in (a, b, a, b, a, b)] == [200] * 6
        assert [timed(a), timed(b)] == [429, 429]
        with redis_server.client() as client:
            assert client.keys("sluice:rl:*") == [b"sluice:rl:{acme}:requests"]
            assert 0 < client.pttl("sluice:rl:{acme}:requests") <= PERIOD_MS


async def test_script_and_local_buckets_agree(redis_server: RedisServer) -> None:
    store = Store(redis_server.url)
    local = LocalBuckets()
    keys = ["sluice:rl:{t}:requests", "sluice:rl:{t}:tokens"]
    steps = [
        [0, 5, PERIOD_MS, 1, 1000, PERIOD_MS, 400],
        [0, 5, PERIOD_MS, 1, 1000, PERIOD_MS, 400],
        [0, 5, PERIOD_MS, 1, 1000, PERIOD_MS, 400],  # refused on tokens, nothing taken
        [1, 1000, PERIOD_MS, -300],  # a refund on the tokens bucket alone
        [0, 5, PERIOD_MS, 1, 1000, PERIOD_MS, 400],
        [1, 1000, PERIOD_MS, -5000],  # never beyond full
    ]
    try:
        for args in steps:
            step_keys = keys if len(args) == 7 else keys[1:]
            remote = await store.run(SCRIPT, step_keys, args)
            here = local.take(step_keys, args)
            assert remote[0] == here[0]
            assert remote[1::3] == here[1::3]  # remaining
            for got, want in zip(remote[2::3] + remote[3::3], here[2::3] + here[3::3], strict=True):
                assert abs(got - want) <= 50  # ms: the two clocks differ by the time between calls
        with redis_server.client() as client:
            assert client.script_exists(SCRIPT.sha) == [True]
            assert client.exists(keys[1]) == 0  # a full bucket leaves no key
    finally:
        await store.aclose()
