"""`sluice bench --scenario cascade`: what the small model first costs and saves, on simulated models.

One gateway process (`sluice serve`) with two in-process simulated backends: `small` (TTFT `SMALL_MS`),
scripted to answer `FAILURE_SHARE` of the requests badly in the five ways the checks see (empty, cut by length,
invalid JSON, a tool call that does not parse, low log-probabilities: `failures:` of a simulated backend), and
`large` (TTFT `LARGE_MS`). Whole (non-streamed) chat requests asking for a JSON object, one at a time:

- `small direct` and `large direct`: the models called by name, no cascade;
  each prompt goes to the runs compared with each other in turn, so that the machine's drift touches all alike;
- `cascade, good answers`: prompts the small model answers well, through `chat` (cascade with every check and
  a log-probability bound): the small-first path; its added latency over `small direct` is the difference of
  the gateway's own time (`x-sluice-overhead-ms`, which leaves out the upstreams' time) and of the client's;
- `cascade, mix`: varied prompts, the scripted share spoiled: the escalation rate by reason, and what an
  escalation costs the client over `large direct`;
- `cascade async, mix`: the same through `chat-async` (`mode: async`): every answer is the small one, the
  failed ones with a background job.
"""

from __future__ import annotations

import asyncio
import collections
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

from gateway.simulation import faults
from gateway.simulation.answers import _canonical
from gateway.telemetry.quantiles import percentile
from tools.bench.overload import Gateway

SMALL_MS, LARGE_MS, TOKENS = 20.0, 200.0, 16
FAILURE_SHARE = 0.25
KINDS = ("empty", "length", "json", "tool_args", "logprob")
MIX = tuple((kind, FAILURE_SHARE / len(KINDS)) for kind in KINDS)
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def config() -> str:
    mix = ", ".join(f"{kind}: {share}" for kind, share in MIX)
    cascade = "small: small-direct, max_total_ms: 5000, min_mean_logprob: -1.0"
    return f"""
backends:
  small: {{type: simulated, ttft_ms: {SMALL_MS}, tpot_ms: 0, tokens: {TOKENS}, failures: {{{mix}}}}}
  large: {{type: simulated, ttft_ms: {LARGE_MS}, tpot_ms: 0, tokens: {TOKENS}}}
models:
  chat: {{backend: large, cascade: {{{cascade}}}}}
  chat-plain: {{backend: large, cascade: {{small: small-direct, max_total_ms: 5000}}}}
  chat-async: {{backend: large, cascade: {{{cascade}, mode: async}}}}
  small-direct: {{backend: small}}
  large-direct: {{backend: large}}
plugins: [cascade]
"""


@dataclass
class Run:
    total_ms: list[float] = field(default_factory=list)
    own_ms: list[float] = field(default_factory=list)
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    escalated_ms: list[float] = field(default_factory=list)
    failed: int = 0


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"question number {i}"}]


def good_prompts(count: int) -> list[int]:
    found: list[int] = []
    i = 0
    while len(found) < count:
        if faults.pick(MIX, b"fault\0" + _canonical(messages(i), "messages")) is None:
            found.append(i)
        i += 1
    return found


async def drive(base: str, models: tuple[str, ...], prompts: list[int]) -> list[Run]:
    """Each prompt sent to each model in turn (interleaved, so that the machine's drift touches all alike)."""
    runs = [Run() for _ in models]
    async with httpx.AsyncClient(timeout=30) as client:
        for n, i in enumerate(prompts):
            for model, run in zip(models, runs, strict=True):
                body: dict[str, object] = {
                    "model": model,
                    "messages": messages(i),
                    "response_format": {"type": "json_object"},
                }
                if n % 5 == 4:
                    body["tools"] = TOOLS  # a fifth ask for a tool call: its arguments are checked
                await one(client, base, body, run)
    return runs


async def one(client: httpx.AsyncClient, base: str, body: dict[str, object], run: Run) -> None:
    started = time.perf_counter()
    response = await client.post(f"{base}/v1/chat/completions", json=body)
    elapsed = (time.perf_counter() - started) * 1000.0
    if response.status_code != 200:
        run.failed += 1
        return
    run.total_ms.append(elapsed)
    run.own_ms.append(float(response.headers["x-sluice-overhead-ms"]))
    outcome = response.headers.get("x-sluice-cascade", "none")
    reason = response.headers.get("x-sluice-cascade-reason")
    run.outcomes[f"{outcome}:{reason}" if reason else outcome] += 1
    if outcome == "escalated":
        run.escalated_ms.append(elapsed)


def cpu_config() -> str:
    """Both models answer at once (no simulated delay), so that a request's time is the gateway's work alone."""
    return (
        config()
        .replace(f"ttft_ms: {SMALL_MS}", "ttft_ms: 0")
        .replace(f"ttft_ms: {LARGE_MS}", "ttft_ms: 0")
        .replace(f"failures: {{{', '.join(f'{kind}: {share}' for kind, share in MIX)}}}", "failures: {empty: 0}")
    )


async def cpu_per_request(models: tuple[str, ...], count: int, rounds: int = 7) -> dict[str, float]:
    """CPU seconds per request through the pipeline in this process (no HTTP), each model's median over
    interleaved rounds: the process's CPU time, which a busy machine's preemption does not inflate."""
    from gateway.config import parse
    from gateway.runtime import Runtime

    runtime = Runtime(parse(cpu_config(), "<bench cascade>"))
    await runtime.start()
    intake = runtime.intake

    async def send(_: object) -> None:
        pass

    async def once(model: str, i: int) -> None:
        body = orjson.dumps({"model": model, "messages": messages(i), "response_format": {"type": "json_object"}})

        async def receive() -> dict[str, object]:
            return {"type": "http.request", "body": body, "more_body": False}

        scope = {"type": "http", "headers": [(b"content-length", str(len(body)).encode())]}
        await intake.asgi(intake.openai, scope, receive, send, "chat/completions")

    samples: dict[str, list[float]] = {model: [] for model in models}
    try:
        for model in models:  # warm-up
            for i in range(200):
                await once(model, i)
        for _ in range(rounds):
            for model in models:
                began = time.process_time()
                for i in range(count):
                    await once(model, i)
                samples[model].append((time.process_time() - began) / count)
    finally:
        await runtime.aclose()
    return {model: sorted(values)[len(values) // 2] for model, values in samples.items()}


def p(values: list[float], q: float) -> float:
    return percentile(sorted(values), q) if values else float("nan")


def main(count: int = 400) -> int:
    good = good_prompts(count)
    mixed = list(range(100_000, 100_000 + count))
    with tempfile.TemporaryDirectory() as tmp:
        gateway = Gateway(config(), Path(tmp))
        try:
            asyncio.run(drive(gateway.base, ("small-direct", "chat-plain", "chat"), good[:50]))  # warm-up
            small, plain, first = asyncio.run(drive(gateway.base, ("small-direct", "chat-plain", "chat"), good))
            large, mix, later = asyncio.run(drive(gateway.base, ("large-direct", "chat", "chat-async"), mixed))
            runs = {
                "small direct": small,
                "cascade without a log-probability bound, good answers": plain,
                "cascade, good answers": first,
                "large direct": large,
                "cascade, mix": mix,
                "cascade async, mix": later,
            }
        finally:
            gateway.stop()
    cpu = asyncio.run(cpu_per_request(("small-direct", "chat-plain", "chat"), count * 5))
    print(report(runs, count))
    direct, unbound, bound = (cpu[m] * 1e6 for m in ("small-direct", "chat-plain", "chat"))
    print(
        "CPU per request through the pipeline in process (models answering at once; median of 7 interleaved "
        f"rounds of {count * 5}): small direct {direct:.1f} µs; small first without a log-probability bound "
        f"{unbound:.1f} µs ({unbound - direct:+.1f} µs); with it {bound:.1f} µs ({bound - direct:+.1f} µs, which "
        "includes the simulated model making the log-probabilities asked of it)."
    )
    return 1 if any(run.failed for run in runs.values()) else 0


def report(runs: dict[str, Run], count: int) -> str:
    lines = [
        f"Cascade: small model TTFT {SMALL_MS:g} ms with {FAILURE_SHARE:.0%} of answers scripted to fail "
        f"({', '.join(KINDS)}), large {LARGE_MS:g} ms; {count} sequential whole requests per run.",
        "",
        "| run | requests | p50 ms | p99 ms | gateway's own p50 ms | own p99 ms | outcomes |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(run.outcomes.items()))
        lines.append(
            f"| {name} | {len(run.total_ms)} | {p(run.total_ms, 0.5):.2f} | {p(run.total_ms, 0.99):.2f} "
            f"| {p(run.own_ms, 0.5):.3f} | {p(run.own_ms, 0.99):.3f} | {outcomes} |"
        )
    small, first = runs["small direct"], runs["cascade, good answers"]
    plain = runs["cascade without a log-probability bound, good answers"]
    mix, large = runs["cascade, mix"], runs["large direct"]
    escalated = sum(v for k, v in mix.outcomes.items() if k.startswith("escalated"))
    lines += [
        "",
        "Small-first path's added latency over calling the small model directly (p50), gateway's own / client's: "
        f"without a log-probability bound {p(plain.own_ms, 0.5) - p(small.own_ms, 0.5):+.3f} / "
        f"{p(plain.total_ms, 0.5) - p(small.total_ms, 0.5):+.3f} ms; with it "
        f"{p(first.own_ms, 0.5) - p(small.own_ms, 0.5):+.3f} / "
        f"{p(first.total_ms, 0.5) - p(small.total_ms, 0.5):+.3f} ms.",
        f"Escalation rate {escalated / max(1, len(mix.total_ms)):.1%}; an escalated request p50 "
        f"{p(mix.escalated_ms, 0.5):.1f} ms against {p(large.total_ms, 0.5):.1f} ms for the large model direct "
        f"(+{p(mix.escalated_ms, 0.5) - p(large.total_ms, 0.5):.1f} ms: the small attempt first); the mix's p50 "
        f"{p(mix.total_ms, 0.5):.1f} ms, mean {sum(mix.total_ms) / max(1, len(mix.total_ms)):.1f} ms against "
        f"the large model's mean {sum(large.total_ms) / max(1, len(large.total_ms)):.1f} ms.",
    ]
    return "\n".join(lines)
