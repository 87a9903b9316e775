"""A limited tenant through a Redis stall: the process goes on deciding from what it knew of the shared bucket.

docs/rate-limits.md: a process that knew the shared bucket was drained keeps refusing on that knowledge (with
the refill since) while it is fresh, and a failed sync does not throw it away, so a stall shorter than the
store's cool-down admits what a token bucket would, not what a fresh in-process bucket would.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

import httpx

from plugins.rate_limit import PERIOD_MS
from tests.support.gateway import gateway_thread
from tests.support.redis import RedisServer
from tests.support.wait import until

KEY = "sk-sluice-stall-test-key"
LIMIT = 600  # requests per minute: 10 a second come back
RATE = 50  # requests a second, five times the refill
KEY_NAME = "sluice:rl:{acme}:requests"


def config(redis_url: str) -> str:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    return f"""
backends: {{sim: {{type: simulated, ttft_ms: 0, tpot_ms: 0, tokens: 2}}}}
models: {{chat: {{backend: sim}}}}
tenants:
  acme: {{keys: ["sha256:{digest}"], rate_limit: {{requests_per_minute: {LIMIT}}}}}
redis: {{url: "{redis_url}"}}
auth: {{required: true}}
plugins: [auth, rate_limit]
"""


async def paced(client: httpx.AsyncClient, url: str, seconds: float, on_time: list[float]) -> list[int]:
    """RATE requests a second for `seconds`, each sent on schedule whatever the earlier ones are doing."""
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}

    async def one() -> int:
        return (await client.post(url, json=body)).status_code

    tasks = []
    start = time.monotonic()
    for i in range(int(seconds * RATE)):
        delay = start + i / RATE - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        on_time.append(time.monotonic() - start - i / RATE)
        tasks.append(asyncio.ensure_future(one()))
    return list(await asyncio.gather(*tasks))


async def test_a_drained_tenant_stays_limited_through_a_redis_stall(redis_server: RedisServer) -> None:
    with gateway_thread(config(redis_server.url)) as gw:
        assert gw.app is not None
        assert gw.app.runtime is not None
        store = gw.app.runtime.store
        assert store is not None
        url = f"{gw.base_url}/chat/completions"
        async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}, timeout=10.0) as client:
            # Drained: the shared bucket is full again only a whole period from now (the script's state).
            with redis_server.client() as redis_client:
                seconds, micros = redis_client.time()
                full_at = seconds * 1000 + micros / 1000 + PERIOD_MS
                redis_client.set(KEY_NAME, f"{full_at:.3f}", px=PERIOD_MS)
            drained_at = time.monotonic()
            on_time: list[float] = []
            load = asyncio.ensure_future(paced(client, url, 3.0, on_time))
            await asyncio.sleep(0.5)  # steady refusals first, each sync learning the bucket is (nearly) empty
            failures = store.failures
            redis_server.pause()  # Redis answers nobody: the next sync times out, the breaker opens for 1 s
            try:
                await asyncio.sleep(0.25)
            finally:
                redis_server.resume()
            statuses = await load
            elapsed = time.monotonic() - drained_at
    assert set(statuses) <= {200, 429}, statuses
    assert store.failures > failures, "the stall was never seen by the gateway: the test tested nothing"
    assert max(on_time) < 0.5, "the load fell behind its schedule"
    admitted = statuses.count(200)
    # A token bucket admits its refill; one process holds at most max(1, lease_share * limit) = 3 units beyond
    # (and the script counts whole units: one more). Before a failed sync kept what it knew: 77 of 150.
    refilled = LIMIT * elapsed / 60
    assert admitted <= refilled + 3 + 1, (admitted, refilled, len(statuses))
    assert admitted >= refilled / 3, (admitted, refilled)  # still served at about the refill: not shut out
    # What was admitted on credit while Redis hung was charged to the shared bucket once it answered again.
    with redis_server.client() as redis_client:
        await until(lambda: redis_client.pttl(KEY_NAME) > 0, timeout=5, what="the bucket key")
