"""The vLLM stand-in's priority scheduling: a full batch preempts the lowest priority only when told to.

Real stand-in replicas on loopback ports, driven over HTTP.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import httpx
import orjson

from tests.support.standins import standin


def body(priority: int, stream: bool, tokens: int | None = None) -> dict[str, object]:
    out: dict[str, object] = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "priority": priority}
    if stream:
        out["stream"] = True
    if tokens is not None:
        out["max_tokens"] = tokens
    return out


async def low_stream(client: httpx.AsyncClient, url: str) -> tuple[list[str], float]:
    """A long low-priority stream: its content pieces, and the longest pause between two of them (s)."""
    pieces: list[str] = []
    last = time.perf_counter()
    longest = 0.0
    async with client.stream("POST", url + "/v1/chat/completions", json=body(10, True)) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if pieces:
                longest = max(longest, now - last)
            last = now
            delta = orjson.loads(line[6:])["choices"]
            if delta and delta[0]["delta"].get("content"):
                pieces.append(delta[0]["delta"]["content"])
    return pieces, longest


async def stats(client: httpx.AsyncClient, url: str) -> dict[str, int]:
    answer: dict[str, int] = (await client.get(url + "/_sim/stats")).json()
    return answer


async def metrics(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """`GET /metrics` as {name: value} (read over the test's own loop: a blocking read would stall it)."""
    text = (await client.get(url + "/metrics")).text
    return {
        line.rpartition(" ")[0].partition("{")[0]: float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def run(preemption: bool) -> tuple[float, list[str], float, dict[str, float], dict[str, float]]:
    with standin("vllm", max_batch=1, ttft_ms=10.0, tpot_ms=10.0, tokens=60, preemption=preemption) as sim:
        async with httpx.AsyncClient(timeout=30) as client:
            low = asyncio.create_task(low_stream(client, sim.url))
            url = sim.url

            async def running() -> bool:
                return (await stats(client, url))["running"] == 1

            await until(running)
            started = time.perf_counter()
            top = asyncio.create_task(client.post(url + "/v1/chat/completions", json=body(0, False, 10)))

            async def queued() -> bool:
                return top.done() or (await stats(client, url))["waiting"] == 1

            await until(queued)
            during = await metrics(client, url)
            answer = await top
            took = time.perf_counter() - started
            assert answer.status_code == 200
            pieces, pause = await low
            return took, pieces, pause, during, await metrics(client, url)


async def test_a_higher_priority_takes_the_slot_and_the_preempted_stream_resumes_whole() -> None:
    took, pieces, pause, during, after = await run(preemption=True)
    _, alone, _, _, _ = await run(preemption=False)
    assert took < 0.35  # ten tokens and one prefill (0.1 s), not the rest of the low stream (0.6 s)
    assert pieces == alone  # paused, nothing lost or repeated
    assert pause >= 0.02  # it waited for the top request (two decodes) and recomputed its prefix
    assert during["vllm:num_requests_running"] == 1
    assert during["vllm:num_requests_waiting"] == 1
    assert after["vllm:num_preemptions_total"] == 1
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:num_requests_waiting"] == 0


async def test_without_preemption_the_higher_priority_waits_for_the_slot_as_vllm_v1_does() -> None:
    took, pieces, _pause, during, after = await run(preemption=False)
    assert took > 0.45  # the low stream's 60 tokens at 10 ms had to finish first
    assert len(pieces) >= 50
    assert during["vllm:num_requests_waiting"] == 1
    assert after["vllm:num_preemptions_total"] == 0
