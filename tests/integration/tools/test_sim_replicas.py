"""`sluice sim --replicas N`: batching, queueing, the prefix cache and vLLM's metrics, over real loopback servers."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import socket
import sys
import time
from typing import Any

import httpx
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from tests.support.standins import Standins, standin

SYSTEM = " ".join(f"rule{i}" for i in range(200))  # 200 words: 200 prompt tokens to prefill


def client(server: Standins, replica: int = 0) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.base_url(replica), api_key="x", max_retries=0)


async def turn(server: Standins, replica: int, messages: list[ChatCompletionMessageParam]) -> tuple[float, int, str]:
    """(time to first content, cached prompt tokens, answer) of one streamed chat turn."""
    async with client(server, replica) as sdk:
        start = time.monotonic()
        stream = await sdk.chat.completions.create(
            model="sim",
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
        )
        ttft, cached, text = 0.0, -1, ""
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or time.monotonic() - start
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                assert chunk.usage.prompt_tokens_details is not None
                cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    return ttft, cached, text


async def test_a_later_turn_hits_the_prefix_cache_of_its_replica_only() -> None:
    with standin(replicas=2, ttft_ms=5, prefill_ms_per_token=2.0, tokens=4) as server:
        first: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "hello there"},
        ]
        cold_ttft, cold_cached, answer = await turn(server, 0, first)
        second: list[ChatCompletionMessageParam] = [
            *first,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "and then"},
        ]
        warm_ttft, warm_cached, _ = await turn(server, 0, second)
        other_ttft, other_cached, _ = await turn(server, 1, second)

        assert cold_cached == 0
        assert other_cached == 0
        # The first turn's 4 + 200 + 4 + 2 = 210 tokens hold 13 full blocks of 16.
        assert warm_cached == 13 * 16
        assert warm_ttft * 3 < cold_ttft, (warm_ttft, cold_ttft)
        assert warm_ttft * 3 < other_ttft, (warm_ttft, other_ttft)
        assert server.metrics(0)["vllm:prefix_cache_hits_total"] == warm_cached
        assert server.metrics(1)["vllm:prefix_cache_hits_total"] == 0
        assert server.metrics(1)["vllm:prefix_cache_queries_total"] > 200


async def test_non_stream_usage_and_the_replica_header() -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    with standin(replicas=2) as server:
        async with httpx.AsyncClient() as http:
            answers = [
                await http.post(server.base_url(i) + "/chat/completions", json={"model": "sim", "messages": messages})
                for i in (1, 1)
            ]
    assert [answer.headers["x-sim-replica"] for answer in answers] == ["1", "1"]
    usage = [answer.json()["usage"] for answer in answers]
    assert usage[0]["prompt_tokens"] == 4 + 200 + 4 + 1
    assert usage[0]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usage[1]["prompt_tokens_details"] == {"cached_tokens": 13 * 16}


async def wait_for(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_requests_beyond_the_batch_wait_in_the_queue() -> None:
    with standin(max_batch=2, tpot_ms=40, tokens=25) as server:
        async with httpx.AsyncClient(timeout=30) as http:
            body = {"model": "sim", "messages": [{"role": "user", "content": "hello"}]}
            url = server.base_url() + "/chat/completions"
            calls = [asyncio.ensure_future(http.post(url, json=body)) for _ in range(5)]

            def queued() -> bool:
                values = server.metrics()
                return values["vllm:num_requests_waiting"] == 3 and values["vllm:num_requests_running"] == 2

            await wait_for(queued)
            assert not any(call.done() for call in calls)
            answers = await asyncio.gather(*calls)
        assert all(answer.status_code == 200 for answer in answers)
        values = server.metrics()
        assert values["vllm:num_requests_waiting"] == 0
        assert values["vllm:num_requests_running"] == 0
        assert server.stats()["finished"] == 5


async def token_gaps(server: Standins, messages: list[ChatCompletionMessageParam]) -> list[float]:
    async with client(server) as sdk:
        stream = await sdk.chat.completions.create(model="sim", messages=messages, stream=True)
        stamps = [time.monotonic() async for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
    return [b - a for a, b in itertools.pairwise(stamps)]


async def test_decode_slows_down_as_the_batch_grows() -> None:
    with standin(max_batch=8, tpot_ms=15, tokens=12, batch_slowdown=0.5) as server:
        alone = await token_gaps(server, [{"role": "user", "content": "alone"}])
        together = await asyncio.gather(*(token_gaps(server, [{"role": "user", "content": f"n{i}"}]) for i in range(8)))
    lone_gap = sum(alone) / len(alone)
    batch_gap = sum(sum(gaps) for gaps in together) / sum(len(gaps) for gaps in together)
    # Expected 15 ms alone and 15 * (1 + 0.5 * 7) = 67.5 ms in a full batch.
    assert batch_gap > 2.5 * lone_gap, (lone_gap, batch_gap)


def prompt(tag: str) -> list[ChatCompletionMessageParam]:
    """A prompt of 4 + 70 = 74 tokens: 4 full blocks of 16, all of which a repeat can hit."""
    return [{"role": "user", "content": " ".join(f"{tag}{i}" for i in range(70))}]


async def cached(http: httpx.AsyncClient, server: Standins, tag: str) -> int:
    # One token of answer: with its framing (78 tokens in all, the last never cached) it fills no fifth block,
    # so a request caches exactly its prompt's 4 blocks.
    body = {"model": "sim", "messages": prompt(tag), "max_tokens": 1}
    answer = await http.post(server.base_url() + "/chat/completions", json=body)
    value: int = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return value


async def test_the_next_turn_finds_the_previous_answer_cached() -> None:
    with standin(block_tokens=16, tokens=40) as server:
        async with client(server) as sdk:
            messages = prompt("a")
            first = await sdk.chat.completions.create(model="sim", messages=messages)
            messages.append({"role": "assistant", "content": first.choices[0].message.content or ""})
            messages.append({"role": "user", "content": "and then"})
            second = await sdk.chat.completions.create(model="sim", messages=messages)
    assert second.usage is not None
    assert second.usage.prompt_tokens_details is not None
    # 74 tokens of prompt, then 3 + 40 + 1 of answer (the last, never computed, not cached): 117 tokens in
    # cache, 7 full blocks. Without the answer cached, only the prompt's 4 would hit.
    assert second.usage.prompt_tokens_details.cached_tokens == 7 * 16


async def test_the_prefix_cache_evicts_the_least_recently_used_blocks() -> None:
    with standin(cache_blocks=8, block_tokens=16) as server:
        async with httpx.AsyncClient() as http:
            assert await cached(http, server, "a") == 0
            assert await cached(http, server, "b") == 0  # the cache is now full: a's 4 blocks, then b's
            assert await cached(http, server, "a") == 64  # a is now the most recently used
            assert await cached(http, server, "c") == 0  # evicts b, the least recently used
            assert await cached(http, server, "a") == 64
            assert await cached(http, server, "b") == 0
        stats = server.stats()
    assert stats["cached_blocks"] == 8
    assert stats["evictions"] == 8


async def test_at_capacity_a_prompt_loses_its_tail_blocks_before_its_head() -> None:
    with standin(cache_blocks=6, block_tokens=16) as server:
        async with httpx.AsyncClient() as http:
            assert await cached(http, server, "a") == 0
            assert await cached(http, server, "b") == 0  # 8 blocks for 6 places: a's last 2 go
            assert await cached(http, server, "a") == 32  # a's first 2 blocks still hit


async def test_metrics_use_vllm_names_and_the_model_label() -> None:
    with standin(model="org/model-7b") as server:
        async with client(server) as sdk:
            await sdk.chat.completions.create(model="org/model-7b", messages=[{"role": "user", "content": "x"}])
        async with httpx.AsyncClient() as http:
            text = (await http.get(server.url + "/metrics")).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ):
        assert re.search(rf'^{name}{{engine="0",model_name="org/model-7b"}} \d', text, re.M), name
    assert "# TYPE vllm:prefix_cache_queries counter" in text


def free_run(count: int) -> int:
    """A port P with P .. P + count - 1 all free, as far as a probe can tell."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base: int = probe.getsockname()[1]
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no run of free ports")


async def test_cli_starts_replicas_on_consecutive_ports_and_prints_each() -> None:
    port = free_run(3)
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "gateway.cli", "sim", "--replicas", "3", "--port", str(port)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        lines = [(await asyncio.wait_for(process.stdout.readline(), 15.0)).decode() for _ in range(3)]
        for i, line in enumerate(lines):
            expected = rf"sluice sim replica {i} \(vllm, model sim\) listening on http://127\.0\.0\.1:{port + i}/v1\n"
            assert re.fullmatch(expected, line), line
        async with httpx.AsyncClient() as http:
            for i in range(3):
                health = await http.get(f"http://127.0.0.1:{port + i}/health")
                assert health.status_code == 200
                assert health.headers["x-sim-replica"] == str(i)
    finally:
        process.terminate()
        await process.communicate()


async def test_a_client_that_leaves_frees_its_batch_slot_and_its_queue_place() -> None:
    with standin(max_batch=1, tpot_ms=50, tokens=200) as server:
        body = {"model": "sim", "messages": [{"role": "user", "content": "long"}], "stream": True}
        url = server.base_url() + "/chat/completions"
        async with httpx.AsyncClient(timeout=30) as first, httpx.AsyncClient(timeout=30) as second:
            async with first.stream("POST", url, json=body) as running:
                chunks = running.aiter_bytes()
                await anext(chunks)  # generating: the one batch slot is taken
                async with second.stream("POST", url, json=body):
                    await wait_for(lambda: server.metrics()["vllm:num_requests_waiting"] == 1)
                # The queued client left: its place is given up.
                await wait_for(lambda: server.metrics()["vllm:num_requests_waiting"] == 0)
                assert server.metrics()["vllm:num_requests_running"] == 1
                await running.aclose()
            # The running client left mid-stream: its slot is free long before its 200 tokens were due.
            await wait_for(lambda: server.metrics()["vllm:num_requests_running"] == 0, timeout=5.0)


async def test_a_client_that_leaves_before_a_whole_answer_frees_its_slot() -> None:
    with standin(max_batch=1, tpot_ms=50, tokens=200) as server:
        body = {"model": "sim", "messages": [{"role": "user", "content": "long"}]}
        async with httpx.AsyncClient() as http:
            call = asyncio.ensure_future(http.post(server.base_url() + "/chat/completions", json=body, timeout=30))
            await wait_for(lambda: server.metrics()["vllm:num_requests_running"] == 1)
            call.cancel()  # the client gives up on a 10 s answer
            with contextlib.suppress(asyncio.CancelledError):
                await call
            await wait_for(lambda: server.metrics()["vllm:num_requests_running"] == 0, timeout=5.0)
        assert server.stats()["generation_tokens"] < 100
