"""Background jobs under faults: Redis stalled, the owner paused past its lease or killed, the store away too long.

Two `sluice serve` processes share one real redis-server; the upstream is a real HTTP server (the scripted
stand-in, which records the connections its client closed mid-answer) or the built-in simulated backend.
What must hold whatever happens: a resume from the start returns every sequence number once, the deltas add
up to the final text, a job ends once (one terminal event, nothing after it), and a failure says why.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import openai
import pytest

from gateway.jobs.store import Job, RedisJobs, terminal_event
from gateway.state.store import Store
from plugins.auth.keys import new_key
from tests.support.gateway import RunningGateway, gateway_process
from tests.support.redis import RedisServer
from tests.support.upstream import Ok, ScriptedUpstream
from tests.support.wait import until_async, wait_until

KEY, KEY_HASH = new_key()
T = TypeVar("T")
TERMINAL_EVENTS = {"response.completed", "response.incomplete", "response.failed"}


def config(backend: str, redis_url: str, background: str = "") -> str:
    return f"""
backends:
  up: {backend}
pool: {{warm_connections: 1}}
models:
  m: {{backend: up}}
tenants:
  acme: {{keys: ["{KEY_HASH}"]}}
plugins: [auth]
redis: {{url: "{redis_url}"}}
background: {{{background}}}
"""


def scripted(up: ScriptedUpstream) -> str:
    return f'{{type: vllm, base_url: "{up.url}/v1"}}'


def sdk(gw: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=KEY, max_retries=0, timeout=10)


def polled(check: Callable[[], T | None], timeout: float, what: str) -> T:
    """`check`'s first answer within `timeout` s; a 503 (the store stalled or its breaker open) is asked again."""

    def once() -> T | None:
        try:
            return check()
        except openai.InternalServerError as exc:
            if exc.status_code != 503:
                raise
            return None

    found = wait_until(once, timeout, interval=0.05, what=what)
    assert found is not None
    return found


def status_is(client: openai.OpenAI, ident: str, *wanted: str) -> Callable[[], Any]:
    def check() -> Any:
        response = client.responses.retrieve(ident)
        return response if response.status in wanted else None

    return check


def ended(client: openai.OpenAI, ident: str, timeout: float = 30.0) -> Any:
    return polled(status_is(client, ident, "completed", "incomplete", "failed", "cancelled"), timeout, "its end")


def replay(client: openai.OpenAI, ident: str) -> list[Any]:
    """Every stored event from the start, checked: each sequence number once, one terminal event, the last."""
    events = polled(lambda: list(client.responses.retrieve(ident, stream=True)), 10.0, "a replay")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    terminal = [e for e in events if e.type in TERMINAL_EVENTS]
    assert len(terminal) == 1, [e.type for e in terminal]
    assert events[-1] is terminal[0]
    return events


def deltas(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def stored(redis_server: RedisServer, ident: str, at_least: int) -> int:
    """How many of the job's events Redis holds, once it holds `at_least` (read from Redis itself)."""

    def count() -> int | None:
        with redis_server.client() as client:
            length = int(client.xlen(f"sluice:bg:{{{ident}}}:events"))
        return length if length >= at_least else None

    found = wait_until(count, 15, what=f"{at_least} events stored")
    assert found is not None
    return found


def test_a_redis_stall_mid_stream_loses_no_event(redis_server: RedisServer, tmp_path: Path) -> None:
    sim = "{type: simulated, ttft_ms: 20, tpot_ms: 20, tokens: 200}"  # 4 s: most of it comes after the stall
    text = config(sim, redis_server.url)
    with gateway_process(text, tmp_path) as owner, gateway_process(text, tmp_path) as reader:
        made = sdk(owner).responses.create(model="m", input="through a stall", background=True)
        before = stored(redis_server, made.id, 10)
        redis_server.pause()
        try:
            # The fault itself: Redis answers nothing for 1 s, mid-stream (twice the job store's 500 ms deadline).
            time.sleep(1.0)
        finally:
            redis_server.resume()
        client = sdk(reader)
        done = ended(client, made.id)
        assert done.status == "completed", done.error
        events = replay(client, made.id)
        assert events[-1].type == "response.completed"
        assert len(events) > before + 40  # most of the job came after the stall
        assert deltas(events) == done.output_text
        assert len(done.output_text.split()) == 200
        # The stall did cost writes (else this test proves nothing), and what waited was written later.
        log = owner.log_text()
        assert "event(s) kept until the store takes them" in log, log
        assert "the store took the events kept" in log, log


def test_an_owner_paused_past_its_lease_ends_failed_once_and_stops(redis_server: RedisServer, tmp_path: Path) -> None:
    with ScriptedUpstream(default=Ok(ttft_ms=20, tpot_ms=30, tokens=600)) as up:  # an 18 s generation
        text = config(scripted(up), redis_server.url, "lease_s: 1")
        with gateway_process(text, tmp_path) as owner, gateway_process(text, tmp_path) as survivor:
            made = sdk(owner).responses.create(model="m", input="paused", background=True)
            client = sdk(survivor)
            polled(status_is(client, made.id, "in_progress"), 15, "in_progress")
            assert owner.process is not None
            owner.process.send_signal(signal.SIGSTOP)
            try:
                failed = polled(status_is(client, made.id, "failed"), 15, "the job failed by the survivor")
            finally:
                owner.process.send_signal(signal.SIGCONT)
            assert failed.error is not None
            assert failed.error.code == "owner_lost"
            resumed = time.monotonic()
            assert up.wait_disconnect(10.0), "the owner did not close its upstream request"
            assert time.monotonic() - resumed < 10.0
            # It stopped because its lease had lapsed, or because a write found the job ended: whichever came first.
            stopped = ("its record had ended", "lapsed")
            wait_until(lambda: any(w in owner.log_text() for w in stopped), 10, what="the owner stopping the job")
            for gateway in (survivor, owner):  # nothing was appended after the end, as either instance reads it
                events = replay(sdk(gateway), made.id)
                assert events[-1].type == "response.failed"
                assert events[-1].response.status == "failed"
                assert sdk(gateway).responses.retrieve(made.id).status == "failed"
    assert len(up.disconnects) == 1


def test_a_one_second_lease_survives_short_redis_stalls(redis_server: RedisServer, tmp_path: Path) -> None:
    sim = "{type: simulated, ttft_ms: 20, tpot_ms: 20, tokens: 60}"
    text = config(sim, redis_server.url, "lease_s: 1")
    with gateway_process(text, tmp_path) as owner, gateway_process(text, tmp_path) as reader:
        client = sdk(reader)
        for _ in range(3):
            made = sdk(owner).responses.create(model="m", input="a healthy job", background=True)
            polled(status_is(client, made.id, "in_progress"), 15, "in_progress")
            redis_server.pause()
            try:
                time.sleep(0.15)  # the fault: one stall, longer than the store's 50 ms deadline
            finally:
                redis_server.resume()
            done = ended(client, made.id)  # polled all along: a lost lease would be found and failed
            assert done.status == "completed", done.error
            events = replay(client, made.id)
            assert deltas(events) == done.output_text
            assert len(done.output_text.split()) == 60
        assert "lost, marked failed" not in reader.log_text()
        assert "lapsed" not in owner.log_text()


def test_a_killed_owners_slots_are_free_within_about_a_lease(redis_server: RedisServer, tmp_path: Path) -> None:
    with ScriptedUpstream(default=Ok(ttft_ms=20, tpot_ms=50, tokens=600)) as up:
        text = config(scripted(up), redis_server.url, "lease_s: 1, max_inflight_per_tenant: 2")
        with gateway_process(text, tmp_path) as owner, gateway_process(text, tmp_path) as survivor:
            mine = [sdk(owner).responses.create(model="m", input=f"slot {i}", background=True) for i in range(2)]
            client = sdk(survivor)
            for made in mine:
                polled(status_is(client, made.id, "in_progress"), 15, "in_progress")
            with pytest.raises(openai.RateLimitError):
                client.responses.create(model="m", input="third", background=True)
            assert owner.process is not None
            owner.process.send_signal(signal.SIGKILL)
            owner.process.wait(10)
            killed = time.monotonic()

            def admitted() -> Any:  # the dead owner's jobs are not read meanwhile: only their lease frees them
                try:
                    return client.responses.create(model="m", input="after the kill", background=True)
                except openai.RateLimitError:
                    return None

            polled(admitted, 10, "a job admitted after the owner died")
            assert time.monotonic() - killed < 3.0  # the lease is 1 s, renewed every 1/3 s
            for made in mine:  # and the dead owner's jobs read as failed
                assert ended(client, made.id).status == "failed"


def test_past_the_buffer_bound_the_job_fails_naming_the_store(redis_server: RedisServer, tmp_path: Path) -> None:
    with ScriptedUpstream(default=Ok(ttft_ms=20, tpot_ms=10, tokens=1000)) as up:
        text = config(scripted(up), redis_server.url, "buffer_events: 16")
        with gateway_process(text, tmp_path) as owner, gateway_process(text, tmp_path) as reader:
            made = sdk(owner).responses.create(model="m", input="too long a stall", background=True)
            stored(redis_server, made.id, 10)
            redis_server.pause()
            try:
                wait_until(lambda: "buffer_events (16)" in owner.log_text(), 15, what="the bound passed")
                assert up.wait_disconnect(10.0), "the upstream request was not stopped at the bound"
            finally:
                redis_server.resume()
            client = sdk(reader)
            failed = ended(client, made.id)
            assert failed.status == "failed"
            assert failed.error is not None
            assert failed.error.code == "store_unavailable"
            assert "job store (redis)" in failed.error.message
            assert "buffer_events" in failed.error.message
            events = replay(client, made.id)  # what was kept is there, in order, then the failure
            assert events[-1].type == "response.failed"
            assert events[-1].response.error is not None
            assert events[-1].response.error.code == "store_unavailable"
            words = deltas(events).split()
            assert words
            assert words == [f"tok{i}" for i in range(len(words))]


def test_a_store_away_past_the_deadline_at_the_end_fails_the_job(redis_server: RedisServer, tmp_path: Path) -> None:
    with ScriptedUpstream(default=Ok(ttft_ms=20, tpot_ms=20, tokens=40)) as up:
        text = config(scripted(up), redis_server.url, "store_wait_s: 0.5")
        with gateway_process(text, tmp_path) as owner, gateway_process(text, tmp_path) as reader:
            made = sdk(owner).responses.create(model="m", input="ends while the store is away", background=True)
            stored(redis_server, made.id, 5)
            redis_server.pause()
            try:  # the upstream finishes meanwhile; the job then waits 0.5 s for the store, and gives up
                wait_until(lambda: "background.store_wait_s" in owner.log_text(), 15, what="the deadline passed")
            finally:
                redis_server.resume()
            client = sdk(reader)
            failed = ended(client, made.id)
            assert failed.status == "failed"
            assert failed.error is not None
            assert failed.error.code == "store_unavailable"
            assert "store_wait_s" in failed.error.message
            events = replay(client, made.id)
            assert events[-1].type == "response.failed"
            assert len(deltas(events).split()) == 40  # every event the upstream sent was kept and written
    assert up.disconnects == []  # the upstream had finished: nothing to cut


async def test_the_store_ends_a_job_once_and_appends_nothing_after_it(redis_server: RedisServer) -> None:
    store = Store(redis_server.url)
    jobs = RedisJobs(store, ttl_s=60, max_events=100, lease_s=1)
    job = Job("resp_a", "responses", "acme", "m", "owner-a", "queued", b'{"id":"resp_a"}')
    try:
        assert await jobs.create(job, cap=1)
        assert await jobs.append(job, [(0, b"e0"), (1, b"e1")], b'{"status":"in_progress"}')
        found = await jobs.get(job.ident)
        assert found is not None
        assert found.status == "in_progress"
        assert await jobs.append(job, [(1, b"e1"), (2, b"e2")], None)  # a repeat of a write that had landed
        assert not await jobs.append(replace(job, owner="owner-b"), [(3, b"x")], None)  # only its owner writes
        # Two instances end it at the same moment: one wins, and the stream has its terminal event only.
        ends = await asyncio.gather(
            jobs.finish(job, "completed", b'{"status":"completed"}', "response.completed", [(3, b"e3")]),
            jobs.finish(job, "failed", b'{"status":"failed"}', "response.failed"),
        )
        assert sorted(ends) == [False, True]
        assert not await jobs.append(job, [(9, b"late")], None)
        events = await jobs.events(job.ident, after=-1)
        found = await jobs.get(job.ident)
        assert found is not None
        last = len(events) - 1
        assert events[-1] == (last, terminal_event(f"response.{found.status}", last, found.object))
        assert [seq for seq, _ in events] == list(range(len(events)))
        assert [data for _, data in events[:3]] == [b"e0", b"e1", b"e2"]
        assert sum(data.startswith(b"event: response.") for _, data in events) == 1
    finally:
        await store.aclose()


async def test_a_lease_that_ran_out_is_reported_and_its_slots_expire(redis_server: RedisServer) -> None:
    store = Store(redis_server.url)
    jobs = RedisJobs(store, ttl_s=60, max_events=100, lease_s=1)
    job = Job("resp_b", "responses", "acme", "m", "owner-a", "queued", b"{}")
    later = Job("resp_c", "responses", "acme", "m", "owner-b", "queued", b"{}")
    try:
        assert await jobs.create(job, cap=1)
        await jobs.renew("owner-a", [job])
        renewal = await jobs.renew("owner-a", [job])
        assert not renewal.lapsed
        assert renewal.ended == {}
        assert not await jobs.create(later, cap=1)
        # No renewal now, as when the owner is paused or dead: the lease and the slot run out together.
        started = time.monotonic()
        await until_async(lambda: jobs.create(later, cap=1), timeout=5.0)
        assert time.monotonic() - started < 2.5

        # The slot's expiry is the renewal's clock plus the lease, the lease key's TTL Redis's own: the two run
        # out within milliseconds of each other, in either order.
        async def lapsed() -> bool:
            return not await jobs.alive("owner-a")

        await until_async(lapsed, timeout=1.0)
        assert time.monotonic() - started < 3.0
        renewal = await jobs.renew("owner-a", [job])
        assert renewal.lapsed  # the owner learns it at its next renewal
        assert await jobs.finish(later, "cancelled", b"{}", "response.failed")
        assert (await jobs.renew("owner-b", [later])).ended == {"resp_c": "cancelled"}
    finally:
        await store.aclose()
