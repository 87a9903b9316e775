"""Admission against engines that report and schedule: a preempting engine makes room for the top class, and
`capacity: auto` reads vLLM's /metrics (the vLLM stand-ins as real HTTP servers, the gateway under uvicorn)."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from typing import Any

import httpx

from tests.integration.plugins.test_admission import BULK, TOP, config, post
from tests.support.gateway import RunningGateway, gateway_thread
from tests.support.llamacpp import gateway_metric, wait_for
from tests.support.standins import standin


def capacity(gw: RunningGateway) -> float:
    return gateway_metric(gw.url, "sluice_admission_capacity", backend="oa")


def in_background(gw: RunningGateway, key: str, **body: Any) -> tuple[threading.Thread, list[httpx.Response]]:
    out: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: out.append(post(gw, key, "long", **body)), daemon=True)
    thread.start()
    return thread, out


def test_the_top_class_passes_a_full_gate_and_the_engine_pauses_the_lower_one() -> None:
    # One slot, held by a batch request of 100 tokens at 20 ms (2 s). The engine preempts by priority.
    with (
        standin("vllm", max_batch=1, ttft_ms=20.0, tpot_ms=20.0, tokens=100, preemption=True) as sim,
        gateway_thread(config(sim.url, kind="vllm", capacity="oa: {max_in_flight: 1, engine_preempts: true}")) as gw,
    ):
        blocker, answers = in_background(gw, BULK, max_tokens=100)
        wait_for(lambda: sim.stats()["running"] == 1, 10, "the batch request running")
        started = time.perf_counter()
        top = post(gw, TOP, "urgent", max_tokens=2)
        took = time.perf_counter() - started
        blocker.join(30)
        assert top.status_code == 200
        assert top.headers["x-sluice-priority"] == "interactive"
        assert took < 1.0  # not after the batch request's 2 s
        assert answers[0].status_code == 200
        assert answers[0].json()["usage"]["completion_tokens"] == 100  # paused, then finished whole
        assert sim.stats()["preemptions"] == 1


def test_without_engine_preemption_the_top_class_waits_at_a_full_gate() -> None:
    with (
        standin("vllm", max_batch=1, ttft_ms=20.0, tpot_ms=20.0, tokens=50) as sim,
        gateway_thread(config(sim.url, kind="vllm", capacity="oa: {max_in_flight: 1}")) as gw,
    ):
        blocker, _ = in_background(gw, BULK, max_tokens=50)
        wait_for(lambda: sim.stats()["running"] == 1, 10, "the batch request running")
        started = time.perf_counter()
        assert post(gw, TOP, "urgent", max_tokens=2).status_code == 200
        assert time.perf_counter() - started > 0.5  # it waited for the batch request's end (1 s)
        blocker.join(30)
        assert sim.stats()["preemptions"] == 0


def test_capacity_auto_learns_vllm_s_batch_from_its_metrics_and_falls_back_when_it_stops() -> None:
    # Configured 4, the engine runs 2: with 4 sent, 2 wait in the engine, which shows its limit.
    auto = "oa: {max_in_flight: 4, capacity: auto, poll_s: 0.05}"
    with ExitStack() as engine:
        sim = engine.enter_context(standin("vllm", max_batch=2, ttft_ms=10.0, tpot_ms=20.0, tokens=40))
        with gateway_thread(config(sim.url, kind="vllm", capacity=auto)) as gw:
            wait_for(lambda: capacity(gw) == 4, 10, "the configured capacity before the engine was seen full")
            threads = [in_background(gw, TOP, max_tokens=40)[0] for _ in range(4)]
            wait_for(lambda: capacity(gw) == 2, 10, "the capacity the engine showed")
            for thread in threads:
                thread.join(30)
            # Three more at once: the third now waits at the gateway, by class, not in the engine.
            before = gateway_metric(gw.url, "sluice_admission_queued_total", backend="oa")
            threads = [in_background(gw, TOP, max_tokens=40)[0] for _ in range(3)]
            wait_for(lambda: sim.stats()["running"] == 2, 10, "two running")
            wait_for(lambda: gateway_metric(gw.url, "sluice_admission_waiting", backend="oa") == 1, 10, "one queued")
            assert sim.stats()["waiting"] == 0
            for thread in threads:
                thread.join(30)
            assert gateway_metric(gw.url, "sluice_admission_queued_total", backend="oa") == before + 1
            engine.close()  # the engine stops: it cannot be read, and what was learned of it is forgotten
            wait_for(lambda: capacity(gw) == 4, 10, "the configured capacity once the engine is gone")


def test_a_top_class_request_goes_to_the_replica_whose_engine_can_make_room() -> None:
    # Two replicas of one slot each: one runs a long top-class request, the other a long batch request. Equal
    # load; only the other replica can preempt for a new top-class request, three times in a row.
    with (
        standin("vllm", replicas=2, max_batch=1, ttft_ms=10.0, tpot_ms=20.0, tokens=150, preemption=True) as sim,
        gateway_thread(
            config(sim.url, kind="vllm", capacity="oa: {max_in_flight: 1, engine_preempts: true}").replace(
                f'base_url: "{sim.url}/v1", api_key: sk-backend}}\n  ob',
                f'endpoints: ["{sim.base_url(0)}", "{sim.base_url(1)}"], api_key: sk-backend, '
                "routing: least_outstanding}\n  ob",
            )
        ) as gw,
    ):
        first, _ = in_background(gw, TOP, max_tokens=150)
        wait_for(lambda: sum(sim.stats(i)["running"] for i in (0, 1)) == 1, 10, "the top-class request running")
        busy = 0 if sim.stats(0)["running"] else 1
        second, _ = in_background(gw, BULK, max_tokens=150)
        wait_for(lambda: sim.stats(1 - busy)["running"] == 1, 10, "the batch request on the other replica")
        for _ in range(3):
            started = time.perf_counter()
            assert post(gw, TOP, "urgent", max_tokens=2).status_code == 200
            assert time.perf_counter() - started < 1.5  # not behind the first one's 3 s
        assert sim.stats(1 - busy)["preemptions"] == 3
        assert sim.stats(busy)["preemptions"] == 0
        first.join(30)
        second.join(30)
