"""The admission plugin's queue (strict classes, weighted turns across tenants, giving up a place) and its
choice of a request's class, on built Exchanges."""

from __future__ import annotations

import asyncio
from typing import cast

import orjson
import pytest

from gateway.config import parse
from gateway.context import Exchange
from gateway.errors import BadRequestError, PermissionDeniedError
from gateway.plugin import hooks
from plugins.admission import Admission
from plugins.admission.queue import Fair, Full, Gate, Waiter
from tests.support.plugins import make


def waiter(tenant: str) -> Waiter:
    return Waiter(cast("asyncio.Future[None]", None), tenant)  # the queue itself never touches the future


def drain(fair: Fair) -> list[str]:
    out = []
    while fair.count:
        out.append(fair.pop().tenant)
    return out


def test_tenants_of_a_class_take_turns_by_weight() -> None:
    weights = {"a": 1, "b": 1, "c": 3}
    fair = Fair(lambda tenant: weights[tenant])
    for tenant in "aaaabbcccccc":
        fair.push(waiter(tenant))
    assert "".join(drain(fair)) == "abcccabcccaa"


def test_a_tenant_that_gives_up_leaves_the_ring() -> None:
    fair = Fair(lambda _: 1)
    leaving = waiter("b")
    for w in (waiter("a"), leaving, waiter("c")):
        fair.push(w)
    assert fair.remove(leaving)
    assert not fair.remove(leaving)
    assert drain(fair) == ["a", "c"]
    assert not fair.tenants
    assert not fair.ring


def gate(capacity: int = 1, classes: int = 3, max_queue: int = 100) -> Gate:
    return Gate("b", capacity, lambda: 1, classes, lambda _: 1, max_queue)


async def test_a_freed_slot_goes_to_the_highest_class_then_in_turn() -> None:
    g = gate()
    assert g.enter()
    assert not g.enter()
    served: list[str] = []

    async def one(tenant: str, rank: int) -> None:
        await g.wait(tenant, rank)
        served.append(f"{tenant}{rank}")

    tasks = [asyncio.create_task(one(t, r)) for t, r in (("x", 2), ("y", 1), ("z", 2), ("w", 0))]
    await asyncio.sleep(0)
    assert g.waiting == 4
    assert g.inflight == 1
    for _ in range(4):
        g.leave(0.1, 0.05)
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert served == ["w0", "y1", "x2", "z2"]
    assert g.inflight == 1
    assert g.waiting == 0
    g.leave(0.1, None)
    assert g.inflight == 0
    assert g.enter()


async def test_a_waiter_cancelled_gives_up_its_place_and_a_slot_handed_to_it_goes_on() -> None:
    g = gate()
    assert g.enter()
    first = asyncio.create_task(g.wait("a", 1))
    second = asyncio.create_task(g.wait("b", 1))
    await asyncio.sleep(0)
    first.cancel()  # cancelled, but its task has not run yet: the hand-over must skip it
    g.leave_now()
    with pytest.raises(asyncio.CancelledError):
        await first
    await second
    assert g.inflight == 1
    assert g.waiting == 0
    third = asyncio.create_task(g.wait("c", 1))
    await asyncio.sleep(0)
    g.leave_now()  # handed to `third`...
    third.cancel()  # ...which gives up at that very moment: the slot is passed on, not lost
    with pytest.raises(asyncio.CancelledError):
        await third
    assert g.inflight == 0
    assert g.waiting == 0
    assert g.enter()


async def test_reserved_slots_are_the_top_class_s_alone() -> None:
    g = Gate("b", 3, lambda: 1, 3, lambda _: 1, 100, reserved=1)
    assert g.enter(2)
    assert g.enter(1)
    assert not g.enter(2)  # the last slot is the top class's
    low = asyncio.create_task(g.wait("a", 2))
    await asyncio.sleep(0)
    assert not low.done()
    await asyncio.wait_for(g.wait("b", 0), 5)  # a top-class request takes it at once, lower ones waiting or not
    assert g.inflight == 3
    g.leave_now()  # the top class's slot frees: the lower class may still not take it
    await asyncio.sleep(0)
    assert not low.done()
    g.leave_now()  # a shared slot frees: the lower class's turn
    await asyncio.wait_for(low, 5)
    assert g.inflight == 2


async def test_the_queue_is_bounded() -> None:
    g = gate(max_queue=1)
    assert g.enter()
    task = asyncio.create_task(g.wait("a", 0))
    await asyncio.sleep(0)
    with pytest.raises(Full):
        await g.wait("b", 0)
    g.leave_now()
    await task


def test_the_prediction_is_the_queue_ahead_over_the_service_rate() -> None:
    g = gate(capacity=2)
    assert g.predicted_s(0) == 0.0  # nothing measured: nothing to predict from
    g.enter()
    g.enter()
    g.leave(2.0, 0.5)
    g.enter()
    fair = g.queues[1]
    for tenant in "abc":
        fair.push(waiter(tenant))
    g.queues[2].push(waiter("d"))
    # Three ahead in classes 0 and 1, itself the fourth: 4 * 2 s / 2 slots, plus the TTFT once through.
    assert g.predicted_s(1) == pytest.approx(4.5)
    assert g.predicted_s(0) == pytest.approx(1.5)


CONFIG = """
backends: {sim: {type: simulated}}
models: {chat: {backend: sim}}
tenants:
  low: {priority: {class: batch}}
  mid: {priority: {class: standard, max_class: interactive}}
admission:
  classes: [{name: interactive}, {name: standard, sheddable: true}, {name: batch, sheddable: true}]
  above_allowed: %s
plugins: [admission]
"""


def exchange(tenant: str, priority: bytes | None = None, **body: object) -> Exchange:
    headers = [(b"x-sluice-priority", priority)] if priority is not None else []
    json = {"model": "chat", "messages": [], **body}
    ex = Exchange("r", "chat/completions", headers, orjson.dumps(json), json, 0.0)
    ex.tenant = tenant
    return ex


def test_the_class_is_the_tenants_unless_it_asks_within_what_it_may() -> None:
    plugin = make(Admission, parse(CONFIG % "clamp", "<test>"))

    def name(ex: Exchange) -> str:
        return plugin.classify(ex).name

    assert name(exchange("low")) == "batch"
    assert name(exchange("mid")) == "standard"
    assert name(exchange("someone")) == "standard"  # not in the config: the default class, the middle one
    assert name(exchange("mid", b"interactive")) == "interactive"
    assert name(exchange("low", b"interactive")) == "batch"  # clamped to its own
    assert name(exchange("mid", b" BATCH ")) == "batch"
    assert name(exchange("mid", background=True)) == "batch"  # background jobs: the lowest class
    with pytest.raises(BadRequestError):
        plugin.classify(exchange("mid", b"gold"))


def test_refuse_mode_answers_403() -> None:
    plugin = make(Admission, parse(CONFIG % "refuse", "<test>"))
    with pytest.raises(PermissionDeniedError):
        plugin.classify(exchange("low", b"standard"))
    assert plugin.classify(exchange("mid", b"interactive")).name == "interactive"


@pytest.mark.parametrize(
    ("admission", "problem"),
    [
        ("{default_class: gold}", "admission.default_class"),
        ("{backends: {nope: {max_in_flight: 2}}}", "admission.backends.nope"),
        ("{classes: [{name: a}, {name: a}]}", "named twice"),
        ("{backends: {sim: {max_in_flight: 2, capacity: auto}}}", "admission.backends.sim.capacity"),
        ("{backends: {sim: {max_in_flight: 2, engine_preempts: true}}}", "admission.backends.sim.engine_preempts"),
        ("{backends: {sim: {max_in_flight: 2, capacity: sometimes}}}", "capacity"),
    ],
)
def test_config_mistakes_are_named(admission: str, problem: str) -> None:
    text = f"""
backends: {{sim: {{type: simulated}}}}
models: {{chat: {{backend: sim}}}}
admission: {admission}
plugins: [admission]
"""
    with pytest.raises(Exception, match=problem.replace(".", r"\.")):
        parse(text, "<test>")


async def test_the_top_class_passes_a_full_gate_only_when_the_engine_preempts() -> None:
    g = Gate("b", 2, lambda: 1, 2, lambda _: 1, 100, 0, preempts=True)
    assert g.enter(1)
    assert g.enter(1)
    assert not g.past(1)  # a lower class never passes a full gate
    assert g.past(0)
    assert g.past(0)
    assert not g.past(0)  # at most the capacity again past the limit
    assert (g.inflight, g.over) == (4, 2)
    g.leave_now(over=True)
    assert (g.inflight, g.over) == (3, 1)
    assert not Gate("b", 1, lambda: 1, 2, lambda _: 1, 100).past(0)  # an engine without preemption: it waits


async def test_a_capacity_read_resizes_the_gate_and_wakes_waiters() -> None:
    g = gate(capacity=1, classes=1)
    assert g.enter()
    waiting = asyncio.ensure_future(g.wait("t", 0))
    await asyncio.sleep(0)
    assert g.waiting == 1
    g.resize(3)  # the engine says it can run three
    await asyncio.wait_for(waiting, 1)
    assert (g.capacity, g.inflight, g.waiting) == (3, 2, 0)
    g.resize(None)  # unreadable: the configured one again
    assert g.capacity == 1


TIERED = """
backends: {oa: {type: openai, base_url: "http://127.0.0.1:9/v1"}}
models: {chat: {backend: oa}}
admission:
  classes: [{name: interactive, service_tier: priority}, {name: batch, sheddable: true}]
plugins: [admission]
"""


def test_on_response_runs_only_where_a_class_asks_for_a_service_tier() -> None:
    # Without a tier to report the hook has nothing to do: the pipeline does not call it (`idle`).
    plain = make(Admission, parse(CONFIG % "clamp", "<test>"))
    assert [name for name, _ in hooks([plain], "on_response")] == []
    assert [name for name, _ in hooks([plain], "on_request")] == ["admission"]
    tiered = make(Admission, parse(TIERED, "<test>"))
    assert [name for name, _ in hooks([tiered], "on_response")] == ["admission"]


def test_the_class_goes_back_to_a_client_that_asked_for_one() -> None:
    plugin = make(Admission, parse(CONFIG % "clamp", "<test>"))
    asked = exchange("low", b"interactive")
    assert plugin.on_request(asked) is None  # nothing to wait for: answered without a coroutine
    assert asked.response_headers == [(b"x-sluice-priority", b"batch")]  # clamped to its own, and told so
    plain = exchange("low")
    assert plugin.on_request(plain) is None
    assert plain.response_headers is None  # its tenant's class: in the metrics and the log, not the head
