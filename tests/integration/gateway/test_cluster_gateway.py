"""Gateways scaled out on one Redis Cluster: a shared limit, a shared cache, and a master failover under load."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from plugins.auth.keys import new_key
from tests.support.gateway import RunningGateway, gateway_process
from tests.support.redis import RedisCluster

KEY, HASHED = new_key()
LIMIT = 30  # requests per minute on model "limited"


def config(url: str) -> str:
    return f"""
backends:
  sim: {{type: simulated, ttft_ms: 1, tpot_ms: 0, tokens: 3}}
models:
  chat: {{backend: sim}}
  limited: {{backend: sim}}
redis: {{url: "{url}"}}
tenants:
  acme:
    keys: ["{HASHED}"]
    rate_limit: {{models: {{limited: {{requests_per_minute: {LIMIT}}}}}}}
auth: {{required: true}}
cache: {{mode: always}}
plugins: [auth, rate_limit, cache]
"""


def ask(gw: RunningGateway, model: str, content: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}]}
    return httpx.post(f"{gw.base_url}/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"})


def test_two_gateways_share_one_limit_and_one_cache(redis_cluster: RedisCluster, tmp_path: Path) -> None:
    text = config(redis_cluster.url)
    with gateway_process(text, tmp_path) as one, gateway_process(text, tmp_path) as two:
        statuses = [ask(gw, "limited", f"q{i}").status_code for i in range(LIMIT + 10) for gw in (one, two)][
            : LIMIT + 10
        ]
        admitted = statuses.count(200)
        assert set(statuses) <= {200, 429}
        # One limit for both, within the leases' documented bound (docs/rate-limits.md): N + N·T/60 + P·M.
        assert LIMIT - 2 <= admitted <= LIMIT + 4, statuses
        # An answer stored by one gateway is a hit on the other: the L2 is the cluster.
        assert ask(one, "chat", "shared question").headers["x-sluice-cache"] == "miss"
        deadline = time.monotonic() + 10
        while ask(two, "chat", "shared question").headers["x-sluice-cache"] != "hit":
            assert time.monotonic() < deadline, "the other gateway never saw the stored answer"
            time.sleep(0.05)


def test_a_master_killed_under_load_fails_no_request(cluster: RedisCluster, tmp_path: Path) -> None:
    with gateway_process(config(cluster.url), tmp_path, "--workers", "2") as gw:
        statuses: list[int] = []
        stop = threading.Event()

        def load() -> None:
            with httpx.Client(timeout=10) as client:
                i = 0
                while not stop.is_set():
                    i += 1
                    body = {"model": "chat", "messages": [{"role": "user", "content": f"unique {i}"}]}
                    answer = client.post(
                        f"{gw.base_url}/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}
                    )
                    statuses.append(answer.status_code)

        worker = threading.Thread(target=load)
        worker.start()
        try:
            deadline = time.monotonic() + 10
            while len(statuses) < 50:  # steady load first
                assert time.monotonic() < deadline
                assert worker.is_alive()
                time.sleep(0.01)
            victim = cluster.master_of("sluice:rl:{acme}:requests")
            replica = cluster.replica_of(victim)
            cluster.wait_until_synced(replica)
            cluster.kill(victim)
            cluster.wait_until(lambda: cluster.master_of("sluice:rl:{acme}:requests") is replica)
            served = len(statuses)
            while len(statuses) < served + 50:  # and on after the replica took over
                assert time.monotonic() < deadline + 30
                assert worker.is_alive()
                time.sleep(0.01)
        finally:
            stop.set()
            worker.join(15)
    assert len(statuses) >= 100
    assert set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
