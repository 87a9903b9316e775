"""`sluice bench --scenario routing`: the route policies over replicas with a prefix cache, one after another.

It needs the replica simulator (`sluice sim --replicas N`, docs/simulator.md): four replicas, each its own
`sluice sim --replicas 1 --port 0` process (so that one can be killed), each printing
`... listening on http://HOST:PORT/v1`, answering with `usage.prompt_tokens_details.cached_tokens` and serving
`GET /_sim/stats` with `finished`. Without that simulator the scenario stops with one line saying so.

The workload is a multi-turn chat: many conversations share a system prompt; each turn sends the whole
conversation so far plus a new user message, streamed; turns arrive as a Poisson process at `LOAD` of the
replicas' estimated capacity. Each policy gets its own backend in one gateway and its own system prompt, so
no policy starts with a cache another one warmed. Measured per policy: TTFT p50/p99 at the client, the
prefix-cache hit rate (cached / prompt tokens) and requests per replica. Then round_robin and prefix run
again with a long shared system prompt (20 KiB, ~3,400 tokens: tool definitions, a shared document), longer
than the part of a prompt the prefix policy cuts into blocks, so that only its turn marks keep a
conversation on its replica (`long_prompt_affinity` counts that in-process too). Then the prefix policy runs
again with one replica killed half-way: every request must still be answered (`failed`: none got an error or no
first token, which another replica would have taken over); the few streams that replica was in the middle
of are `cut`, since their first tokens had reached the client. The pick's own cost is measured first,
in-process (`pick_cost`).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import timeit
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from gateway.telemetry.quantiles import percentile

POLICIES = ("round_robin", "least_outstanding", "session", "prefix")
REPLICAS = 4
MAX_BATCH = 4
LOAD = 0.7
PREFILL_MS = 1.0  # per uncached prompt token: what a prefix-cache hit saves
SYSTEM_WORDS = 100  # the shared system prompt; each turn adds USER_WORDS and an answer
LONG_SYSTEM_CHARS = 20_480  # the long-prompt case: longer than the 16 KiB the prefix policy cuts into blocks
LONG_POLICIES = ("round_robin", "prefix")
USER_WORDS = (20, 80)
MAX_TURNS = 10
NEW_CONVERSATION = 0.15
SIM_FLAGS = (
    *("--ttft-ms", "20", "--prefill-ms-per-token", str(PREFILL_MS), "--tpot-ms", "10", "--tokens", "24"),
    *("--max-batch", str(MAX_BATCH), "--cache-blocks", "4096", "--max-model-len", "32768"),
)
LISTENING = re.compile(rb"listening on (http://\S+/v1)")


class NeedsSimulator(Exception):
    """The replica simulator (sluice sim --replicas) is not there."""


@dataclass
class Phase:
    policy: str
    ttft_ms: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    failures: int = 0  # no answer: an error status, or the stream failed before its first token
    cut: int = 0  # answered, then the stream broke: its replica died mid-answer, after bytes reached the client
    per_replica: list[int] = field(default_factory=list)
    killed: int | None = None  # the replica killed half-way, whose count stops there

    def line(self) -> str:
        p50 = percentile(sorted(self.ttft_ms), 0.5) if self.ttft_ms else 0.0
        p99 = percentile(sorted(self.ttft_ms), 0.99) if self.ttft_ms else 0.0
        hit = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        # The balance is the survivors': the killed replica's share ends half-way.
        kept = [n for i, n in enumerate(self.per_replica) if i != self.killed]
        mean = sum(kept) / len(kept) if kept else 0.0
        peak = max(kept) / mean if mean else 0.0
        counts = [f"{n} (killed)" if i == self.killed else str(n) for i, n in enumerate(self.per_replica)]
        return (
            f"| {self.policy} | {len(self.ttft_ms)} | {p50:.0f} | {p99:.0f} | {hit:.0%} | "
            f"{' / '.join(counts)} | {peak:.2f} | {self.failures} | {self.cut} |"
        )


def pick_cost(endpoints: int = 8, turns: int = 6) -> dict[str, float]:
    """CPU microseconds per request of each policy's work (key + pick + served) over realistic chat requests.

    The requests are conversations of up to `turns` turns after a 1,740-character system prompt (up to
    7,500 characters in all); the figure `sum(range(1000))` of the same run says how fast the machine was.
    """

    async def measure() -> dict[str, float]:
        from gateway.context import Exchange
        from gateway.settings import RoutingSettings
        from gateway.upstream.pool import PoolLimits
        from gateway.upstream.replica import Endpoint
        from gateway.upstream.route import build

        pool = [Endpoint(f"http://10.0.0.{i}:8000/v1", PoolLimits(), None, False) for i in range(endpoints)]
        system = "You are a helpful assistant. " * 60
        bodies = []
        for c in range(64):
            messages: list[dict[str, str]] = [{"role": "system", "content": system}]
            for t in range(turns):
                messages.append({"role": "user", "content": f"question {c}.{t} " + "about the thing " * 40})
                bodies.append({"model": "m", "messages": list(messages), "user": f"u{c}"})
                messages.append({"role": "assistant", "content": "an answer " * 30})
        exchanges = [Exchange("r", "chat/completions", [], b"", body, 0.0) for body in bodies]
        results = {}
        for name in POLICIES:
            policy = build(RoutingSettings(policy=name), 3.0)
            now = time.monotonic()
            for ex in exchanges:  # warm: every prefix has been seen somewhere, as in steady state
                key = policy.key(ex)
                policy.served(key, policy.pick(key, pool, now)[0], now)
            index = 0

            def one() -> None:
                nonlocal index
                ex = exchanges[index % len(exchanges)]
                index += 1
                key = policy.key(ex)  # noqa: B023 - measured in this iteration only
                endpoint, _ = policy.pick(key, pool, now)  # noqa: B023
                policy.served(key, endpoint, now)  # noqa: B023

            count = 20_000
            # CPU time of this thread: on a shared machine, time spent preempted is not the pick's.
            best = min(timeit.repeat(one, number=count, repeat=5, timer=time.thread_time))
            results[name] = best / count * 1e6
        reference = min(timeit.repeat("sum(range(1000))", number=5000, repeat=5, timer=time.thread_time))
        results["reference: sum(range(1000))"] = reference / 5000 * 1e6
        for endpoint in pool:
            await endpoint.aclose()
        return results

    return asyncio.run(measure())


def long_prompt_affinity(
    replicas: int = 4, conversations: int = 15, turns: int = 5, system_chars: int = 20_480, **routing: Any
) -> tuple[int, int, list[int]]:
    """(later turns that stayed on their conversation's replica, later turns, turns per replica) under
    `routing: prefix`.

    Conversations share a system prompt longer than the hashed blocks (`max_blocks * block_chars`, 16 KiB by
    default), so only the turn marks, which cover the whole prompt, can tell them apart. The turns of all
    conversations come in rounds, each round a burst in a random order: a turn stays in flight on its replica
    until the round ends, so the load spreads the conversations and weighs against what a replica holds, as
    in a busy gateway. In-process: the policy's key, pick and served, the load as a scrape would report it;
    no servers.
    """

    async def measure() -> tuple[int, int, list[int]]:
        from gateway.context import Exchange
        from gateway.settings import RoutingSettings
        from gateway.upstream.pool import PoolLimits
        from gateway.upstream.replica import Endpoint
        from gateway.upstream.route import build

        pool = [Endpoint(f"http://10.0.0.{i}:8000/v1", PoolLimits(), None, False) for i in range(replicas)]
        policy = build(RoutingSettings(policy="prefix", **routing), 3.0)
        rng = random.Random(7)
        rule = " ".join(f"rule{rng.randrange(10_000)}" for _ in range(system_chars // 9))
        system = {"role": "system", "content": rule[:system_chars]}
        talks: list[list[dict[str, str]]] = [[system] for _ in range(conversations)]
        placed: dict[int, Any] = {}
        stayed = later = 0
        served = dict.fromkeys(pool, 0)
        now = time.monotonic()
        for turn in range(turns):
            flight = dict.fromkeys(pool, 0)
            for endpoint in pool:
                endpoint.scraped(0.0, 0.0, 0.0, now)
            order = list(range(conversations))
            rng.shuffle(order)  # arrivals in no fixed order
            for index in order:
                talk = talks[index]
                talk.append({"role": "user", "content": f"question {index}.{turn} " + "about it " * 30})
                body = {"model": "m", "messages": list(talk)}
                key = policy.key(Exchange("r", "chat/completions", [], b"", body, 0.0))
                endpoint, _ = policy.pick(key, pool, now)
                policy.served(key, endpoint, now)
                flight[endpoint] += 1
                served[endpoint] += 1
                endpoint.scraped(0.0, float(flight[endpoint]), 0.0, now)
                if turn:
                    later += 1
                    stayed += endpoint is placed[index]
                placed[index] = endpoint
                talk.append({"role": "assistant", "content": f"answer {index}.{turn} " + "it is so " * 25})
        for endpoint in pool:
            await endpoint.aclose()
        return stayed, later, [served[endpoint] for endpoint in pool]

    return asyncio.run(measure())


def start_replica() -> tuple[subprocess.Popen[bytes], str]:
    command = [sys.executable, "-m", "gateway.cli", "sim", "--replicas", "1", "--port", "0", *SIM_FLAGS]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    seen = b""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen += line
        found = LISTENING.search(line)
        if found:
            return proc, found.group(1).decode()
    proc.kill()
    raise NeedsSimulator(
        "the routing scenario needs the replica simulator (`sluice sim --replicas N`): "
        + (seen.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
    )


def gateway_config(urls: list[str]) -> str:
    endpoints = ", ".join(f'"{url}"' for url in urls)
    lines = ["backends:"]
    for name in POLICIES:
        lines.append(
            f"  {name}: {{type: vllm, endpoints: [{endpoints}], routing: {name},"
            " outlier: {consecutive_failures: 1, base_ejection_s: 5}}"
        )
    lines.append("pool: {warm_connections: 8}")
    lines.append("models:")
    lines.extend(f"  {name}: {{backend: {name}, upstream_model: sim}}" for name in POLICIES)
    return "\n".join(lines) + "\n"


async def conversation_turn(
    http: httpx.AsyncClient, model: str, messages: list[dict[str, str]], user: str, phase: Phase
) -> None:
    body = {
        "model": model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": user,
    }
    started = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                phase.failures += 1
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    if first is None:
                        phase.failures += 1
                    else:
                        phase.cut += 1
                    return
                for choice in chunk.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if first is None:
                            first = time.perf_counter()
                        text.append(piece)
                usage = chunk.get("usage")
                if usage:
                    phase.prompt_tokens += usage.get("prompt_tokens", 0)
                    phase.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
    except httpx.HTTPError:
        if first is None:
            phase.failures += 1
        else:
            phase.cut += 1
        return
    if first is not None:
        phase.ttft_ms.append((first - started) * 1000.0)
    messages.append({"role": "assistant", "content": "".join(text)})


async def run_phase(
    gateway: str,
    model: str,
    seconds: float,
    rate: float,
    seed: int,
    kill: subprocess.Popen[bytes] | None = None,
    urls: list[str] | None = None,
    system_chars: int = 0,
) -> Phase:
    """One policy's turn; with `kill`, that replica is killed half-way, after its count so far (`urls`) is read;
    with `system_chars`, the shared system prompt is that long."""
    name = model if kill is None else f"{model}, one replica killed"
    phase = Phase(f"{name}, {system_chars // 1024} KiB system prompt" if system_chars else name)
    rng = random.Random(seed)
    rules = SYSTEM_WORDS if not system_chars else system_chars // 9
    system = f"System prompt {seed}: " + " ".join(f"rule{rng.randrange(10_000)}" for _ in range(rules))
    if system_chars:
        system = system[:system_chars]
    conversations: list[list[dict[str, str]]] = []
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(base_url=gateway, timeout=60.0, limits=limits) as http:
        tasks: set[asyncio.Task[None]] = set()
        busy: set[int] = set()
        end = time.monotonic() + seconds
        killed = False
        while time.monotonic() < end:
            await asyncio.sleep(rng.expovariate(rate))
            if kill is not None and not killed and time.monotonic() > end - seconds / 2:
                if urls is not None:
                    phase.per_replica = await asyncio.to_thread(finished, urls)
                kill.send_signal(signal.SIGKILL)
                killed = True
            # Now and then a new conversation (always when every open one is waiting for its answer).
            free = [i for i in range(len(conversations)) if i not in busy and len(conversations[i]) < 2 * MAX_TURNS]
            if not free or rng.random() < NEW_CONVERSATION:
                conversations.append([{"role": "system", "content": system}])
                free = [len(conversations) - 1]
            index = rng.choice(free)
            words = " ".join(f"w{rng.randrange(100_000)}" for _ in range(rng.randrange(*USER_WORDS)))
            conversations[index].append({"role": "user", "content": words})
            busy.add(index)
            task = asyncio.create_task(
                conversation_turn(http, model, conversations[index], f"conversation-{seed}-{index}", phase)
            )
            task.add_done_callback(lambda _, i=index: busy.discard(i))  # type: ignore[misc]
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
    return phase


def finished(urls: list[str]) -> list[int]:
    counts = []
    for url in urls:
        try:
            stats: Any = httpx.get(url.removesuffix("/v1") + "/_sim/stats", timeout=2.0).json()
            counts.append(int(stats.get("finished", 0)))
        except (httpx.HTTPError, ValueError):
            counts.append(-1)
    return counts


def main(seconds: float = 30.0) -> int:
    """Run every policy, print the table; 0 when every request succeeded and the targets are met."""
    costs = pick_cost()
    try:
        replicas = [start_replica() for _ in range(REPLICAS)]
    except NeedsSimulator as exc:
        print(f"sluice bench: {exc}", file=sys.stderr)
        return 2
    urls = [url for _, url in replicas]
    # Capacity: MAX_BATCH at once per replica, a turn taking ttft + the prefill of ~1,000 uncached tokens (a
    # mid-conversation turn where nothing is cached) + 24 tokens of decode slowed by the batch.
    turn_s = 0.02 + PREFILL_MS / 1000.0 * 1000 + 24 * 0.010 * 1.3
    rate = LOAD * REPLICAS * MAX_BATCH / turn_s
    return _run(replicas, urls, rate, seconds, costs)


def _run(
    replicas: list[tuple[subprocess.Popen[bytes], str]], urls: list[str], rate: float, seconds: float, costs: Any
) -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "routing.yaml"
        path.write_text(gateway_config(urls))
        gateway = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "-c", str(path), "--port", str(port), "--log-level", "error"]
        )
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(f"{base}/readyz", timeout=1.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    print("sluice bench: the routing gateway did not become ready", file=sys.stderr)
                    return 2
                time.sleep(0.1)
            phases = []
            for seed, policy in enumerate(POLICIES):
                before = finished(urls)
                phase = asyncio.run(run_phase(base, policy, seconds, rate, seed))
                phase.per_replica = [a - b for a, b in zip(finished(urls), before, strict=True)]
                phases.append(phase)
            for seed, policy in enumerate(LONG_POLICIES, start=50):
                before = finished(urls)
                phase = asyncio.run(run_phase(base, policy, seconds, rate, seed, system_chars=LONG_SYSTEM_CHARS))
                phase.per_replica = [a - b for a, b in zip(finished(urls), before, strict=True)]
                phases.append(phase)
            before = finished(urls)
            killed = asyncio.run(run_phase(base, "prefix", seconds, rate, 99, kill=replicas[-1][0], urls=urls))
            # The killed replica's count is the one read just before it died; the others', at the end.
            at_kill = killed.per_replica or before
            after = finished(urls)
            killed.killed = len(urls) - 1
            killed.per_replica = [
                (at_kill[i] if i == killed.killed else after[i]) - before[i] for i in range(len(urls))
            ]
            phases.append(killed)
        finally:
            gateway.send_signal(signal.SIGTERM)
            gateway.wait(10)
            for proc, _ in replicas:
                proc.kill()
                proc.wait(5)
    print(f"## Routing across {REPLICAS} replicas ({rate:.1f} turns/s offered, {seconds:g} s per policy)\n")
    columns = "TTFT p50 ms | TTFT p99 ms | prefix-cache hits | requests per replica | busiest / mean | failed | cut"
    print(f"| policy | requests | {columns} |")
    print("|---|---|---|---|---|---|---|---|---|")
    for phase in phases:
        print(phase.line())
    print(
        "\nPick cost, 8 endpoints (key + pick + served, µs per request): "
        + ", ".join(f"{name} {us:.1f}" for name, us in costs.items())
    )
    affinity = []
    for count in (2, 3, 4):
        stayed, later, spread = long_prompt_affinity(replicas=count)
        affinity.append(f"{count} replicas {stayed}/{later} ({' / '.join(map(str, spread))} turns per replica)")
    print(
        f"\nLong shared prompt ({LONG_SYSTEM_CHARS // 1024} KiB), in-process, 15 conversations x 5 turns in bursts:"
        " later turns that stayed on their replica: " + "; ".join(affinity)
    )
    print(
        "\nfailed: no answer (an error, or nothing before the first token: those are retried on another replica);"
        " cut: the stream broke after its first token, on the replica killed mid-answer (nothing can retry it)."
    )
    return 0 if all(phase.failures == 0 for phase in phases) else 1


if __name__ == "__main__":
    sys.exit(main(float(os.environ.get("SLUICE_BENCH_ROUTING_S", "30"))))
