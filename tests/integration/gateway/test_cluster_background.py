"""Background jobs on a Redis Cluster: two `sluice serve` processes share one exact per-tenant cap, and a job made
on one is read, resumed and cancelled on the other; the store's own steps checked against the cluster itself.

A job's keys hash by its id and its tenant's slots by the tenant, so they sit in different hash slots (mostly on
different masters): admission is two scripts, never one that names both (docs/architecture.md, "Background mode").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import openai
import pytest

from gateway.jobs.store import APPEND, CREATE, FINISH, RESERVE, Job, RedisJobs, inflight_key, job_key
from gateway.state.cluster import slot
from gateway.state.store import Store
from plugins.auth.keys import new_key
from tests.support.gateway import RunningGateway, gateway_process
from tests.support.redis import RedisCluster
from tests.support.wait import wait_until

KEY, KEY_HASH = new_key()
OTHER_KEY, OTHER_HASH = new_key()
CAP = 3
T = TypeVar("T")


def config(url: str) -> str:
    return f"""
backends:
  quick: {{type: simulated, ttft_ms: 20, tpot_ms: 20, tokens: 40}}
  slow: {{type: simulated, ttft_ms: 20, tpot_ms: 200, tokens: 500}}
pool: {{warm_connections: 1}}
models:
  m: {{backend: quick}}
  slow: {{backend: slow}}
tenants:
  acme: {{keys: ["{KEY_HASH}"]}}
  rival: {{keys: ["{OTHER_HASH}"]}}
plugins: [auth]
redis: {{url: "{url}"}}
background: {{max_inflight_per_tenant: {CAP}, lease_s: 2}}
"""


def sdk(gw: RunningGateway, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0, timeout=10)


def until(check: Callable[[], T | None], what: str, timeout: float = 15.0) -> T:
    found = wait_until(check, timeout, interval=0.05, what=what)
    assert found is not None
    return found


def test_two_gateways_share_jobs_and_one_exact_cap(redis_cluster: RedisCluster, tmp_path: Path) -> None:
    text = config(redis_cluster.url)
    with gateway_process(text, tmp_path) as one, gateway_process(text, tmp_path) as two:
        # Made on one, polled to its end and resumed on the other.
        made = sdk(one).responses.create(model="m", input="shared", background=True)
        assert made.status == "queued"
        other = sdk(two)

        def done() -> Any:
            response = other.responses.retrieve(made.id)
            return response if response.status not in ("queued", "in_progress") else None

        assert until(done, "its end").status == "completed"
        rest = list(other.responses.retrieve(made.id, stream=True, starting_after=30))
        assert [e.sequence_number for e in rest] == list(range(31, rest[-1].sequence_number + 1))
        assert rest[-1].type == "response.completed"
        every = list(sdk(one).responses.retrieve(made.id, stream=True))
        assert [e.sequence_number for e in every] == list(range(len(every)))
        text_of = "".join(e.delta for e in every if e.type == "response.output_text.delta")
        assert text_of == other.responses.retrieve(made.id).output_text
        assert len(text_of.split()) == 40

        # Twice the cap at once, spread over both instances: exactly the cap is admitted, the rest refused.
        outcomes: list[str | int] = []
        lock = threading.Lock()

        def start(gw: RunningGateway, i: int) -> None:
            try:
                ident: str | int = sdk(gw).responses.create(model="slow", input=f"long {i}", background=True).id
            except openai.APIStatusError as exc:
                ident = exc.status_code
            with lock:
                outcomes.append(ident)

        threads = [threading.Thread(target=start, args=((one, two)[i % 2], i)) for i in range(2 * CAP)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        running = [o for o in outcomes if isinstance(o, str)]
        assert len(running) == CAP, outcomes
        assert sorted(o for o in outcomes if isinstance(o, int)) == [429] * CAP
        with pytest.raises(openai.RateLimitError) as caught:
            other.responses.create(model="slow", input="one more", background=True)
        assert "background requests in flight" in caught.value.message
        sdk(two, OTHER_KEY).responses.create(model="m", input="theirs", background=True)  # a cap per tenant

        # A running job is followed live from the instance that does not run it, then cancelled there: its
        # slot is free at once, for either instance.
        live = sdk(two).responses.retrieve(running[0], stream=True)
        events = iter(live)
        assert [next(events).sequence_number for _ in range(3)] == [0, 1, 2]
        live.close()
        assert other.responses.cancel(running[0]).status == "cancelled"
        assert sdk(one).responses.retrieve(running[0]).status == "cancelled"
        again = sdk(one).responses.create(model="slow", input="after the cancel", background=True)
        for ident in [*running[1:], again.id]:
            assert sdk(one).responses.cancel(ident).status == "cancelled"


async def test_the_store_keeps_its_rules_across_hash_slots(redis_cluster: RedisCluster) -> None:
    store = Store(redis_cluster.url)
    jobs = RedisJobs(store, ttl_s=60, max_events=100, lease_s=1)
    job = Job("resp_cluster_a", "responses", "tenant-a", "m", "owner-a", "queued", b'{"id":"resp_cluster_a"}')
    later = Job("resp_cluster_b", "responses", "tenant-a", "m", "owner-b", "queued", b"{}")
    assert slot(job_key(job.ident)) != slot(inflight_key(job.tenant))  # the case one script could not serve
    try:
        await jobs.prepare()
        masters = [s.port for s in redis_cluster.servers if redis_cluster.is_master(s.port)]
        assert len(masters) == 3
        for port in masters:  # loaded on every master, not only the first
            with redis_cluster.client(port) as client:
                assert client.script_exists(*(s.sha for s in (RESERVE, CREATE, APPEND, FINISH))) == [True] * 4
        assert await jobs.create(job, cap=1)
        assert not await jobs.create(later, cap=1)
        found = await jobs.get(job.ident)
        assert found is not None
        assert found.tenant == "tenant-a"
        assert await jobs.append(job, [(0, b"e0")], b'{"status":"in_progress"}')
        await jobs.renew("owner-a", [job])  # the first: no lease before it
        renewal = await jobs.renew("owner-a", [job])
        assert (renewal.lapsed, renewal.ended, renewal.lost) == (False, {}, set())
        # The slot runs out while the lease is kept (its node away longer than a lease), and an admission
        # takes it: the next renewal says the job is lost rather than let it run uncounted.
        with redis_cluster.client(redis_cluster.master_of(inflight_key(job.tenant)).port) as client:
            client.zadd(inflight_key(job.tenant), {job.ident: time.time() - 1})
        assert await jobs.create(later, cap=1)
        renewal = await jobs.renew("owner-a", [job])
        assert renewal.lost == {job.ident}
        assert await jobs.finish(later, "cancelled", b"{}", "response.failed")
        await jobs.release(later)
        assert (await jobs.renew("owner-b", [later])).ended == {later.ident: "cancelled"}
        await jobs.delete(job)
        assert await jobs.get(job.ident) is None
    finally:
        await store.aclose()
