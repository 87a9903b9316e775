"""The Redis job store's admission on its own: the slot first, then the record, and the slot given back when
the record cannot be written (a store that answers as scripted, so each half's failure is exact)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, cast

import pytest

from gateway.jobs.store import CREATE, RESERVE, Job, RedisJobs, inflight_key, job_key
from gateway.state.store import Script, Store, StoreUnavailable


class Scripted:
    """Runs RESERVE as admitted, fails the scripts named in `failing`, and records every call."""

    def __init__(self, *failing: Script, pipeline_fails: bool = False, full: bool = False) -> None:
        self.failing = failing
        self.full = full
        self.pipeline_fails = pipeline_fails
        self.calls: list[tuple[str, list[Any]]] = []

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        self.calls.append(("RESERVE" if script is RESERVE else "CREATE", [*keys]))
        if script in self.failing:
            raise StoreUnavailable("timed out")
        return 0 if self.full and script is RESERVE else 1

    async def pipeline(self, commands: Sequence[Sequence[Any]], *, always: bool = False) -> list[Any]:
        assert always  # sent whatever the breaker, which the failure has just opened
        self.calls += [("pipeline", [*command]) for command in commands]
        if self.pipeline_fails:
            raise StoreUnavailable("down")
        return [1] * len(commands)


JOB = Job("resp_1", "responses", "acme", "m", "me", "queued", b"{}")


def jobs(store: Scripted) -> RedisJobs:
    return RedisJobs(cast(Store, store), ttl_s=60, max_events=16, lease_s=10)


def test_the_slot_is_reserved_before_the_record_is_written() -> None:
    store = Scripted()
    assert asyncio.run(jobs(store).create(JOB, cap=2))
    assert store.calls == [("RESERVE", [inflight_key("acme")]), ("CREATE", [job_key("resp_1")])]


def test_a_record_that_cannot_be_written_gives_its_slot_back_and_fails() -> None:
    store = Scripted(CREATE)
    with pytest.raises(StoreUnavailable):
        asyncio.run(jobs(store).create(JOB, cap=2))
    assert store.calls[-1] == ("pipeline", ["ZREM", inflight_key("acme"), "resp_1"])


def test_a_give_back_that_fails_too_still_fails_the_create() -> None:
    store = Scripted(CREATE, pipeline_fails=True)  # the reservation then runs out with its lease score
    with pytest.raises(StoreUnavailable):
        asyncio.run(jobs(store).create(JOB, cap=2))


def test_no_reservation_no_record() -> None:
    store = Scripted(RESERVE)
    with pytest.raises(StoreUnavailable):
        asyncio.run(jobs(store).create(JOB, cap=2))
    assert store.calls == [("RESERVE", [inflight_key("acme")])]


def test_a_tenant_at_its_cap_gets_no_record() -> None:
    store = Scripted(full=True)
    assert not asyncio.run(jobs(store).create(JOB, cap=2))
    assert store.calls == [("RESERVE", [inflight_key("acme")])]
