"""A tenant's requests in flight are capped: at its cap it gets a 429, and the others are served meanwhile."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import openai
import pytest

from plugins.auth.keys import new_key
from tests.support.gateway import RunningGateway, gateway_thread
from tests.support.upstream import Ok, ScriptedUpstream

GREEDY, GREEDY_HASH = new_key()
OTHER, OTHER_HASH = new_key()
CAPPED, CAPPED_HASH = new_key()
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture()
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream(default=Ok(tokens=3)) as up:
        yield up


@pytest.fixture()
def gateway(upstream: ScriptedUpstream) -> Iterator[RunningGateway]:
    # Four connections to the backend: without a cap one tenant's slow streams would hold them all, and
    # everyone else would wait pool_timeout_s for a 503. The default cap is half of them.
    config = f"""
backends:
  oa: {{type: openai, base_url: "{upstream.url}/v1", api_key: sk-backend}}
pool: {{max_connections: 4, warm_connections: 0, pool_timeout_s: 2}}
models:
  chat: {{backend: oa}}
tenants:
  greedy: {{keys: ["{GREEDY_HASH}"]}}
  other: {{keys: ["{OTHER_HASH}"]}}
  capped: {{keys: ["{CAPPED_HASH}"], max_concurrent: 1}}
auth: {{required: true}}
plugins: [auth, rate_limit]
"""
    with gateway_thread(config) as gw:
        yield gw


def chat(gw: RunningGateway, key: str, **extra: object) -> httpx.Response:
    body = {"model": "chat", "messages": MESSAGES, **extra}
    return httpx.post(f"{gw.base_url}/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})


class Streams:
    """Slow streams held open by a tenant, each in a thread, until released."""

    def __init__(self, gw: RunningGateway, key: str, count: int) -> None:
        self.started = threading.Semaphore(0)
        self.statuses: list[int] = []
        self.threads = [threading.Thread(target=self.one, args=(gw, key), daemon=True) for _ in range(count)]
        for thread in self.threads:
            thread.start()
        for _ in self.threads:
            assert self.started.acquire(timeout=30), "a stream never started"

    def one(self, gw: RunningGateway, key: str) -> None:
        body = {"model": "chat", "messages": MESSAGES, "stream": True}
        headers = {"authorization": f"Bearer {key}"}
        with httpx.stream("POST", f"{gw.base_url}/chat/completions", json=body, headers=headers, timeout=30) as r:
            self.statuses.append(r.status_code)
            released = False
            for _ in r.iter_bytes():
                if not released:
                    self.started.release()
                    released = True

    def join(self) -> None:
        for thread in self.threads:
            thread.join(30)


def test_a_tenant_at_its_cap_is_refused_while_another_is_served(
    gateway: RunningGateway, upstream: ScriptedUpstream
) -> None:
    upstream.script(*[Ok(ttft_ms=5, tpot_ms=100, tokens=30)] * 2)  # two streams of 3 s
    held = Streams(gateway, GREEDY, 2)  # the default cap: half of pool.max_connections
    refused = chat(gateway, GREEDY)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "concurrency_limit"
    assert error["type"] == "requests"
    assert "limit 2 in flight" in error["message"]
    assert "rate_limit.max_concurrent" in error["message"]
    assert refused.headers["retry-after"] == "1"
    assert refused.headers["retry-after-ms"] == "1000"
    # The other tenant is served, at once, on the connections the cap kept free.
    for _ in range(5):
        served = chat(gateway, OTHER)
        assert served.status_code == 200, served.text
    assert len(upstream.requests) == 2 + 5  # the refusal never went upstream
    held.join()
    assert held.statuses == [200, 200]
    # Its streams have ended: the tenant is served again.
    assert chat(gateway, GREEDY).status_code == 200


def test_a_tenants_own_cap_and_the_sdk_sees_a_rate_limit(gateway: RunningGateway, upstream: ScriptedUpstream) -> None:
    upstream.script(Ok(ttft_ms=5, tpot_ms=100, tokens=20))
    held = Streams(gateway, CAPPED, 1)
    client = openai.OpenAI(base_url=gateway.base_url, api_key=CAPPED, max_retries=0)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.code == "concurrency_limit"
    assert "tenants.capped.max_concurrent" in caught.value.message
    assert "limit 1 in flight" in caught.value.message
    held.join()
    # A request that was refused left nothing counted: the next one is served.
    answer = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].finish_reason == "stop"
    assert gateway.app is not None
    assert gateway.app.runtime is not None
    gateway.settle()
    (limiter,) = [p for p in gateway.app.runtime.plugins if p.name == "rate_limit"]
    assert getattr(limiter, "concurrency").inflight == {}  # noqa: B009 - the plugin's own counter, not the core's
