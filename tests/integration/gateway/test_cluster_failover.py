"""Planned failovers of a real Redis Cluster under load through the gateway: not one request fails.

A `CLUSTER FAILOVER` moves a master's slots to its replica in milliseconds; the gateway's client learns it
from `MOVED` replies and reloads its slot map in the background. A reload answered by a node that has not yet
heard of the failover used to drop the new master while a request awaited its first connection to it, and
the cancelled connect came up to the pipeline as if the gateway were shutting down (503 `gateway_shutdown`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx

from gateway.state.cluster import Cluster
from gateway.state.store import Store
from plugins.auth.keys import new_key
from tests.support.gateway import gateway_process
from tests.support.redis import RedisCluster, RedisServer

KEY, HASHED = new_key()
RATE = 20  # requests a second
FAILOVERS = 4


def config(url: str) -> str:
    return f"""
backends:
  sim: {{type: simulated, ttft_ms: 1, tpot_ms: 0, tokens: 3}}
models:
  chat: {{backend: sim}}
redis: {{url: "{url}"}}
tenants:
  acme: {{keys: ["{HASHED}"], rate_limit: {{requests_per_minute: 100000}}}}
auth: {{required: true}}
cache: {{mode: always}}
plugins: [auth, rate_limit, cache]
"""


def masters(cluster: RedisCluster) -> list[RedisServer]:
    return [s for s in cluster.servers if s.proc is not None and cluster.is_master(s.port)]


def fail_over(cluster: RedisCluster, master: RedisServer) -> None:
    """The planned kind: the replica asks for the slots, the master hands them over once it has caught up."""
    replica = cluster.replica_of(master)
    cluster.wait_until_synced(replica)
    with cluster.client(replica.port) as client:
        client.execute_command("CLUSTER", "FAILOVER")
    cluster.wait_until(lambda: cluster.is_master(replica.port) and not cluster.is_master(master.port))
    cluster.wait_until_ok()


def test_planned_failovers_under_load_fail_no_request(cluster: RedisCluster, tmp_path: Path) -> None:
    with gateway_process(config(cluster.url), tmp_path, "--workers", "2") as gw, httpx.Client(timeout=15) as client:
        answers: list[Future[httpx.Response]] = []
        stop = threading.Event()
        headers = {"authorization": f"Bearer {KEY}"}

        def ask(i: int) -> httpx.Response:
            # Unique questions: each is a cache lookup and a store on the cluster, and a rate-limit lease.
            body = {"model": "chat", "messages": [{"role": "user", "content": f"question {i}"}]}
            return client.post(f"{gw.base_url}/chat/completions", json=body, headers=headers)

        def load(pool: ThreadPoolExecutor) -> None:
            start = time.monotonic()
            i = 0
            while not stop.is_set():
                delay = start + i / RATE - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                answers.append(pool.submit(ask, i))
                i += 1

        with ThreadPoolExecutor(max_workers=8) as pool:
            loader = threading.Thread(target=load, args=(pool,))
            loader.start()
            try:
                time.sleep(2.0)  # not a wait for a condition: steady load before the first failover
                done = 0
                while done < FAILOVERS:
                    for master in masters(cluster)[: FAILOVERS - done]:
                        fail_over(cluster, master)
                        done += 1
                        time.sleep(4.0)  # load on the new map before the next failover
            finally:
                stop.set()
                loader.join(15)
            statuses = [answer.result().status_code for answer in answers]
        log = gw.log_text()
    assert len(statuses) >= RATE * 4, len(statuses)
    failed = {status: statuses.count(status) for status in set(statuses) if status != 200}
    assert failed == {}, (failed, log[-3000:])
    assert "gateway_shutdown" not in log
    assert "cancelled from below" not in log


async def test_a_new_master_dropped_by_a_stale_reload_fails_no_call(cluster: RedisCluster) -> None:
    """The race itself, made certain: a call follows MOVED to the new master and, while it waits for its first
    connection there, a reload answered with the map from before the failover drops that node."""
    store = Store(cluster.url, timeout_s=1.0)
    try:
        assert await store.execute("SET", "raced", "value") == b"OK"
        client = store.client
        assert isinstance(client, Cluster)
        before = await client.masters[0].call(("CLUSTER", "SLOTS"))  # what a node not yet told answers
        old = cluster.master_of("raced")
        replica = cluster.replica_of(old)
        fail_over(cluster, old)
        call = asyncio.ensure_future(store.execute("GET", "raced"))  # MOVED: to a node it has no connection to
        target = ("127.0.0.1", replica.port)
        deadline = time.monotonic() + 5
        while not (target in client.nodes and not client.nodes[target].live):
            assert not call.done(), "answered before the race could be set up"
            assert time.monotonic() < deadline
            await asyncio.sleep(0)  # one loop iteration: the connect takes at least one
        answered = next(node for node in client.masters if node.port != replica.port)
        client.apply(before, answered)  # the stale reload: the new master is not a master in it, so it is closed
        assert client.nodes.get(target) is None
        assert await call == b"value"  # sent again, and redirected again, never cancelled
        assert store.failures == 0
    finally:
        await store.aclose()
