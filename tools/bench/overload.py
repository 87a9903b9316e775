"""`sluice bench --scenario overload`: priority classes holding the top class's latency while replicas are overloaded.

Four simulated vLLM replicas (`sluice sim --replicas 4`, one process, `MAX_BATCH` running at once each,
queueing by `priority` as vLLM's priority scheduling does) serve one model. Their capacity is estimated from
the simulator's flags (a request holds a batch slot for its TTFT and its decode, slowed by the batch), and the
load is driven open-loop (Poisson arrivals) at `LOAD` times it: one tenant in the top class (`interactive`,
not sheddable) sends `TOP_SHARE` of the requests, three tenants in a sheddable class (`batch`) the rest.

Four runs, each through its own gateway process: the top tenant alone at its own rate (its unloaded TTFT),
then the overload with the admission plugin (classes, `max_in_flight` = the replicas' batch, the gateway's
queue, shedding by predicted TTFT, `vllm_priority` sent upstream) against replicas that preempt by priority
(`sluice sim --priority-preemption`, as SGLang's priority scheduling and vLLM's V0 engine do) with
`engine_preempts` (the top class let through a full gate; `RESERVED_PREEMPTING` slots per replica kept for it,
so that fewer batch streams need pausing); the same against replicas that do not (vLLM's V1
engine) with `RESERVED` slots per replica kept for the top class instead; then the same arrivals through a
gateway without it, everyone piling into the engines' own queues. TTFT is the client's time to the first
streamed chunk (the first token comes with it). A refused request's time is the client's time to the 503 and
the gateway's own view of it (`x-sluice-overhead-ms`).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from gateway.telemetry.quantiles import percentile
from plugins.auth.keys import new_key
from tools.bench.fleet import Placement, pinned, placement

REPLICAS = 4
MAX_BATCH = 4
TTFT_MS, TPOT_MS, TOKENS, SLOWDOWN = 30.0, 25.0, 40, 0.1
RESERVED = 2  # of MAX_BATCH per replica, kept for the top class (engines that do not preempt)
RESERVED_PREEMPTING = 1  # the same where the engines preempt: fewer lower-class streams to pause
LOAD = 2.0
TOP_SHARE = 0.2
BULK_TENANTS = 3
BATCH_SLO_MS = 3000
SIM_FLAGS = (
    *("--ttft-ms", str(TTFT_MS), "--tpot-ms", str(TPOT_MS), "--tokens", str(TOKENS)),
    *("--max-batch", str(MAX_BATCH), "--prefill-ms-per-token", "0", "--batch-slowdown", str(SLOWDOWN)),
)
LISTENING = re.compile(rb"listening on (http://\S+/v1)")


@dataclass
class Side:
    """One class's requests in one run."""

    sent: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    refused: int = 0
    refusal_ms: list[float] = field(default_factory=list)  # the client's time to an immediate 503
    waited_ms: list[float] = field(default_factory=list)  # the client's time to a 503 after waiting its SLO
    refusal_own_ms: list[float] = field(default_factory=list)  # the gateway's own (x-sluice-overhead-ms)
    # Per immediate refusal, its server-timing stages (ms): `parse` runs from the request's first byte, so it
    # holds the wait for the event loop to start the request's task; `rest` is the own time after the stages.
    refusal_stages: list[dict[str, float]] = field(default_factory=list)
    failed: int = 0  # anything else: an error status other than a 503 shed, or a broken stream


def service_s() -> float:
    """A request's time in a full batch: its TTFT, then its other tokens, each slowed by its batch peers."""
    return (TTFT_MS + (TOKENS - 1) * TPOT_MS * (1 + SLOWDOWN * (MAX_BATCH - 1))) / 1000.0


def capacity() -> float:
    return REPLICAS * MAX_BATCH / service_s()


def start_sim(preemption: bool = False, cpu: int | None = None) -> tuple[subprocess.Popen[bytes], list[str]]:
    command = [sys.executable, "-m", "gateway.cli", "sim", "--replicas", str(REPLICAS), "--port", "0", *SIM_FLAGS]
    command = [*pinned(cpu), *command]
    if preemption:
        command.append("--priority-preemption")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    urls: list[str] = []
    deadline = time.monotonic() + 30
    while len(urls) < REPLICAS and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        found = LISTENING.search(line)
        if found:
            urls.append(found.group(1).decode())
    if len(urls) < REPLICAS:
        proc.kill()
        raise RuntimeError("the replica simulator (`sluice sim --replicas 4`) did not start")
    return proc, urls


def config(urls: list[str], keys: dict[str, str], classes: bool, preempts: bool = False) -> str:
    endpoints = ", ".join(f'"{url}"' for url in urls)
    tenants = "\n".join(
        f'  {name}: {{keys: ["{digest}"], priority: {{class: {"interactive" if name == "top" else "batch"}}}}}'
        if classes
        else f'  {name}: {{keys: ["{digest}"]}}'
        for name, digest in keys.items()
    )
    text = f"""
backends:
  fleet: {{type: vllm, endpoints: [{endpoints}], routing: {{policy: least_outstanding, metrics: false}}}}
pool: {{warm_connections: 8}}
models:
  chat: {{backend: fleet, upstream_model: sim}}
tenants:
{tenants}
auth: {{required: true}}
"""
    if not classes:
        return text + "plugins: [auth]\n"
    # How the top class finds a slot: let through a full gate for the engine to make room, or kept for it.
    room = f"engine_preempts: true, reserved: {RESERVED_PREEMPTING}" if preempts else f"reserved: {RESERVED}"
    return (
        text
        + f"""admission:
  classes:
    - {{name: interactive, ttft_slo_ms: 60000, vllm_priority: 0}}
    - {{name: batch, ttft_slo_ms: {BATCH_SLO_MS}, sheddable: true, vllm_priority: 10}}
  backends: {{fleet: {{max_in_flight: {MAX_BATCH}, {room}}}}}
plugins: [auth, admission]
"""
    )


class Gateway:
    def __init__(self, text: str, directory: Path, cpu: int | None = None) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        path = directory / f"overload-{port}.yaml"
        path.write_text(text)
        self.base = f"http://127.0.0.1:{port}"
        serve = ["serve", "-c", str(path), "--port", str(port), "--log-level", "error"]
        self.proc = subprocess.Popen([*pinned(cpu), sys.executable, "-m", "gateway.cli", *serve])
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{self.base}/readyz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the overload gateway did not become ready")
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def one(client: httpx.AsyncClient, base: str, key: str, side: Side, seq: int) -> None:
    body = {"model": "chat", "messages": [{"role": "user", "content": f"question {seq}"}], "stream": True}
    started = time.perf_counter()
    side.sent += 1
    try:
        async with client.stream(
            "POST", f"{base}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
        ) as response:
            if response.status_code == 503:
                answer = await response.aread()
                elapsed = (time.perf_counter() - started) * 1000.0
                side.refused += 1
                if b" waited " in answer:
                    side.waited_ms.append(elapsed)
                    return
                side.refusal_ms.append(elapsed)
                own = float(response.headers.get("x-sluice-overhead-ms", "nan"))
                side.refusal_own_ms.append(own)
                side.refusal_stages.append(stages(response.headers.get("server-timing", ""), own))
                return
            if response.status_code != 200:
                await response.aread()
                side.failed += 1
                return
            first = True
            async for _ in response.aiter_raw():
                if first:
                    side.ttft_ms.append((time.perf_counter() - started) * 1000.0)
                    first = False
    except httpx.HTTPError:
        side.failed += 1


def stages(timing: str, own: float) -> dict[str, float]:
    """`server-timing` as stage -> ms, and `rest`: the gateway's own time not in a stage (sending the answer)."""
    found: dict[str, float] = {}
    for entry in timing.split(","):
        name, _, duration = entry.strip().partition(";dur=")
        if duration and name != "overhead":
            found[name] = float(duration)
    found["rest"] = own - sum(found.values())
    return found


async def drive(base: str, keys: dict[str, str], rates: dict[str, float], seconds: float, seed: int) -> dict[str, Side]:
    """Poisson arrivals per tenant for `seconds`; each class's figures ("top" or "batch")."""
    rng = random.Random(seed)
    sides = {"top": Side(), "batch": Side()}
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with httpx.AsyncClient(limits=limits, timeout=120.0) as client:
        tasks: list[asyncio.Task[None]] = []

        async def arrivals(tenant: str, rate: float) -> None:
            side = sides["top" if tenant == "top" else "batch"]
            end = time.perf_counter() + seconds
            seq = 0
            while True:
                await asyncio.sleep(rng.expovariate(rate))
                if time.perf_counter() >= end:
                    return
                seq += 1
                tasks.append(asyncio.create_task(one(client, base, keys[tenant], side, seq)))

        await asyncio.gather(*(arrivals(tenant, rate) for tenant, rate in rates.items() if rate > 0))
        await asyncio.gather(*tasks)
    return sides


def p(values: list[float], q: float) -> float:
    return percentile(sorted(values), q) if values else float("nan")


def row(run: str, name: str, side: Side, seconds: float) -> str:
    refusals = (
        f"{p(side.refusal_ms, 0.5):.1f} / {p(side.refusal_ms, 0.99):.1f} ms (own {p(side.refusal_own_ms, 0.5):.3f}"
        f" / {p(side.refusal_own_ms, 0.99):.3f} ms)"
        if side.refusal_ms
        else "-"
    )
    waited = str(len(side.waited_ms)) if side.refused else "-"
    return (
        f"| {run} | {name} | {side.sent / seconds:.1f} | {len(side.ttft_ms)} | {side.refused} | {waited} | "
        f"{side.failed} | {p(side.ttft_ms, 0.5):.0f} | {p(side.ttft_ms, 0.99):.0f} | {refusals} |"
    )


def main(seconds: float = 30.0, pin: bool = True) -> int:
    """Run the four runs, print the table; 0 when the targets are met.

    Placed as the other scenarios are (tools/bench/fleet.py): each gateway on one CPU, the replicas' simulator and
    this load generator on the other, so that what the gateway's figures hold is its own work and its loop's
    waits, not the load generator's turns on the same core."""
    where: Placement = placement(pin)
    cpus = os.sched_getaffinity(0)
    if where.harness_cpu is not None:
        os.sched_setaffinity(0, {where.harness_cpu})
    try:
        return _run(seconds, where)
    finally:
        os.sched_setaffinity(0, cpus)  # the scenarios after this one place their own processes from every CPU


def _run(seconds: float, where: Placement) -> int:
    cap = capacity()
    total = LOAD * cap
    top_rate = TOP_SHARE * total
    bulk = (total - top_rate) / BULK_TENANTS
    credentials = {name: new_key() for name in ["top", *(f"bulk{i}" for i in range(BULK_TENANTS))]}
    keys = {name: key for name, (key, _) in credentials.items()}
    digests = {name: digest for name, (_, digest) in credentials.items()}
    overload = {"top": top_rate, **{f"bulk{i}": bulk for i in range(BULK_TENANTS)}}
    sims: list[subprocess.Popen[bytes]] = []
    fleets: dict[bool, list[str]] = {}
    try:
        for preemption in (True, False):
            sim, fleets[preemption] = start_sim(preemption, where.harness_cpu)
            sims.append(sim)
    except RuntimeError as exc:
        for sim in sims:
            sim.kill()
        print(f"sluice bench: {exc}", file=sys.stderr)
        return 2
    results: list[tuple[str, dict[str, Side]]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for run, classes, preempts, rates in (
                ("unloaded (top alone)", True, True, {"top": top_rate}),
                ("2x, with classes, engines preempt", True, True, overload),
                ("2x, with classes, engines do not preempt", True, False, overload),
                ("2x, without classes", False, False, overload),
            ):
                gateway = Gateway(config(fleets[preempts], digests, classes, preempts), Path(tmp), where.gateway_cpu)
                try:
                    results.append((run, asyncio.run(drive(gateway.base, keys, rates, seconds, len(results)))))
                finally:
                    gateway.stop()
                time.sleep(2.0)  # the engines drain what the last run left
    finally:
        for sim in sims:
            sim.kill()
            sim.wait(5)
    print(
        f"## Overload: {REPLICAS} replicas x {MAX_BATCH} slots, capacity ~{cap:.1f} req/s, offered {LOAD:g}x "
        f"({total:.1f} req/s; top class {TOP_SHARE:.0%}), {seconds:g} s a run; {where.note}\n"
    )
    print(
        "| run | class | offered req/s | served | refused (503) | of which after waiting | failed | TTFT p50 ms "
        "| TTFT p99 ms | immediate refusal p50 / p99 (gateway's own view) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for run, sides in results:
        for name, side in sides.items():
            if side.sent:
                print(row(run, name, side, seconds))
    unloaded = p(results[0][1]["top"].ttft_ms, 0.99)
    with_classes = results[1][1]["top"]
    no_preemption = results[2][1]["top"]
    without = results[3][1]["top"]
    ratio = p(with_classes.ttft_ms, 0.99) / unloaded
    print(
        f"\nTop class TTFT p99 over its unloaded p99: {ratio:.2f}x with classes and engines that preempt (target "
        f"<= 1.25x), {p(no_preemption.ttft_ms, 0.99) / unloaded:.2f}x with classes and engines that do not, "
        f"{p(without.ttft_ms, 0.99) / unloaded:.2f}x without; top-class refusals with classes: "
        f"{with_classes.refused} and {no_preemption.refused} (target 0)."
    )
    shed = results[1][1]["batch"].refusal_own_ms
    if shed:
        print(
            f"Immediate refusals in the gateway's own view: p50 {p(shed, 0.5):.3f} ms, p99 {p(shed, 0.99):.3f} ms, "
            f"max {max(shed):.3f} ms (target < 1 ms)."
        )
        print(breakdown(results[1][1]["batch"].refusal_stages))
    met = ratio <= 1.25 and with_classes.refused == 0 and (not shed or max(shed) < 1.0)
    return 0 if met else 1


def breakdown(refusals: list[dict[str, float]]) -> str:
    """Where the immediate refusals' own time went: each stage's p50 and p99, and the refusals over 1 ms."""
    names = sorted({name for stages in refusals for name in stages}, key=lambda n: (n == "rest", n))
    parts = [f"{name} {p([s.get(name, 0.0) for s in refusals], 0.5):.3f} / "
             f"{p([s.get(name, 0.0) for s in refusals], 0.99):.3f}" for name in names]  # fmt: skip
    slow = [s for s in refusals if sum(s.values()) >= 1.0]
    worst = {name: sum(s.get(name, 0.0) for s in slow) for name in names}
    share = ", ".join(f"{name} {value / max(1e-9, sum(worst.values())):.0%}" for name, value in worst.items())
    return (
        f"Immediate refusals by stage, p50 / p99 ms (parse counts from the first byte, so it holds the wait for "
        f"the event loop to start the request): {'; '.join(parts)}. Of the {len(slow)} over 1 ms, their time: "
        f"{share or '-'}."
    )


if __name__ == "__main__":
    numbers = [arg for arg in sys.argv[1:] if not arg.startswith("--")]
    sys.exit(main(float(numbers[0]) if numbers else 30.0, "--no-pin" not in sys.argv))
