"""The optional verifier: a chat model's yes or no, bounded by its own deadline, never a hit on doubt."""

from __future__ import annotations

import time

import httpx

from plugins.semantic_cache.verifier import verify
from tests.support.standins import standin
from tests.support.upstream import Ok, ScriptedUpstream, Stall, Status

A = "Convert 5 km to miles"
B = "Convert five kilometres to miles"


async def test_a_yes_is_the_same_answer_and_anything_else_is_not() -> None:
    with ScriptedUpstream() as up:
        up.script(Ok(text="Yes"), Ok(text="No"), Ok(text="maybe"), Status(500))
        async with httpx.AsyncClient() as client:
            verdicts = [await verify(client, f"{up.url}/v1", "judge", A, B, deadline_s=5) for _ in range(4)]
        assert verdicts == [True, False, False, False]
        sent = up.requests[0].json
        assert sent["model"] == "judge"
        assert sent["temperature"] == 0
        assert A in sent["messages"][0]["content"]
        assert B in sent["messages"][0]["content"]


async def test_a_stalled_verifier_costs_at_most_its_deadline() -> None:
    with ScriptedUpstream() as up:
        up.script(Stall())
        async with httpx.AsyncClient() as client:
            started = time.perf_counter()
            verdict = await verify(client, f"{up.url}/v1", "judge", A, B, deadline_s=0.2)
            took = time.perf_counter() - started
    assert verdict is False
    assert 0.2 <= took < 1.5  # the deadline, with room for a loaded machine


async def test_its_latency_is_one_short_chat_round_trip() -> None:
    # Against the simulated backend: the verifier adds its model's time to first token and one more token.
    with standin("vllm", ttft_ms=40, tpot_ms=5, tokens=2) as sim:
        async with httpx.AsyncClient() as client:
            await verify(client, sim.base_url(), "small", A, B, deadline_s=5)  # the connection, opened once
            took = []
            for _ in range(5):
                started = time.perf_counter()
                await verify(client, sim.base_url(), "small", A, B, deadline_s=5)
                took.append(time.perf_counter() - started)
    assert min(took) >= 0.04
    assert sorted(took)[2] < 0.04 * 10  # generous: the machine is shared
