"""`sluice bench`: what the gateway adds to latency and what it costs, measured against the upstream it proxies.

Two simulated upstreams (`sluice sim`: `paced` streams 20 tokens 5 ms apart, `fast` answers at once) run pinned
to one CPU together with this load generator; the gateway (`sluice serve`, one worker) runs pinned to another.
The same request bodies go straight to an upstream ("direct") and through the gateway ("through"), the two
sides interleaved cell by cell and their order swapped every round. The method is the one behind
docs/benchmarks.md: open-loop arrivals at fixed rates, overhead = through - direct within a round, median over
rounds; max throughput from a closed loop; gateway CPU read from /proc.

The load generator is `gateway.pool.Pool` on uvloop: a general-purpose client costs more per request than the
gateway does and would hide it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
import os
import platform
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import orjson

from gateway.pool import Pool, PoolError, PoolLimits

SCENARIO = Path("bench/scenarios/overhead.yaml")
HEADERS = b"content-type: application/json\r\n"
OVERHEAD_HEADER = b"x-sluice-overhead-ms"
# Streams use /v1/completions because its first event is the first token, written the moment the request
# arrives. A chat stream opens with a role-only event and its first token waits on the upstream's
# millisecond-granular timer, which would round away part of the gateway's request path.
STREAM_PATH = b"/v1/completions"
PLAIN_PATH = b"/v1/chat/completions"
TOKEN = re.compile(rb'"(?:text|content)":"[^"]')  # a non-empty token; role-only and final events have ""
PROMPTS = ("Tell me about rivers.", "Say something calm.", "Describe the sea.", "Name a colour.")
CLIENT_LIMITS = PoolLimits(
    max_connections=1024,
    max_idle=1024,
    warm=0,
    pool_timeout=30.0,
    first_byte_timeout=30.0,
    idle_read_timeout=30.0,
    keepalive_expiry=3600.0,
)
CLK_TCK = os.sysconf("SC_CLK_TCK")
SATURATED_PERCENT = 90.0
TARGET_TTFT_MS = 0.6
TARGET_RPS = 4000.0
TARGET_CPU_MS = 0.25
TARGET_GAP_MS = 0.1


class BenchError(Exception):
    """The benchmark could not run (a process did not start, a port did not open)."""


@dataclass(frozen=True, slots=True)
class BenchOptions:
    rounds: int = 3
    rates: tuple[float, ...] = (10.0, 50.0, 200.0)
    cell_seconds: float = 3.0  # per rate, per side, per round
    min_requests: int = 20
    max_requests: int = 1000
    concurrency: int = 32  # closed-loop connections, and the burst that warms connections before a cell
    max_warmup_seconds: float = 0.5
    max_seconds: float = 2.5  # measured closed-loop time per mode, per side, per round
    tokens: int = 20
    tpot_ms: float = 5.0
    plain_tokens: int = 5
    pin: bool = True
    scenario: str | None = None
    write: str | None = None
    command: str = ""
    preset: str = "default"


DEFAULT = BenchOptions()
QUICK = replace(DEFAULT, rounds=1, cell_seconds=1.5, max_warmup_seconds=0.3, max_seconds=1.5, preset="quick")
SMOKE = replace(
    DEFAULT,
    rounds=1,
    cell_seconds=0.25,
    min_requests=3,
    max_requests=50,
    concurrency=8,
    max_warmup_seconds=0.1,
    max_seconds=0.4,
    pin=False,
    preset="smoke",
)


@dataclass(frozen=True, slots=True)
class Workload:
    path: bytes
    bodies: tuple[bytes, ...]
    stream: bool


@dataclass(slots=True)
class Samples:
    """One cell's measurements on one side (ms)."""

    latency: list[float] = field(default_factory=list)  # TTFT for streams, the whole exchange otherwise
    gaps: list[float] = field(default_factory=list)  # between consecutive token chunks
    own: list[float] = field(default_factory=list)  # the gateway's x-sluice-overhead-ms
    errors: int = 0


@dataclass(frozen=True, slots=True)
class Run:
    """One closed-loop run: its measured window only."""

    seconds: float
    requests: int
    gateway_cpu_s: float
    core_busy_s: float  # the gateway's CPU, busy with anything
    harness_cpu_s: float
    samples: Samples


@dataclass(slots=True)
class Results:
    cells: dict[tuple[str, float, str], list[Samples]] = field(default_factory=dict)
    runs: dict[tuple[str, str], list[Run]] = field(default_factory=dict)
    others_percent: float = math.nan  # the machine's CPU time used by processes other than ours
    tcp: tuple[int, int] = (0, 0)  # machine-wide: segments retransmitted, retransmission timeouts

    def all_samples(self, side: str) -> list[Samples]:
        found = [s for (_, _, name), rounds in self.cells.items() if name == side for s in rounds]
        return found + [r.samples for (_, name), runs in self.runs.items() if name == side for r in runs]


@dataclass(frozen=True, slots=True)
class Side:
    name: str  # "direct" or "through"
    paced: Pool
    fast: Pool


@dataclass(frozen=True, slots=True)
class Dist:
    p50: float
    p99: float
    count: int


@dataclass(frozen=True, slots=True)
class Row:
    rate: float
    direct: Dist
    through: Dist
    added_p50: float  # median over rounds of (through p50 - direct p50)
    added_p99: float  # from all rounds' samples pooled
    own: Dist  # what the gateway says it added


@dataclass(frozen=True, slots=True)
class GapRow:
    rate: float
    direct_mean: float
    through_mean: float
    direct_p99: float
    through_p99: float
    count: int

    @property
    def added_mean(self) -> float:
        return self.through_mean - self.direct_mean

    @property
    def added_p99(self) -> float:
        return self.through_p99 - self.direct_p99


@dataclass(frozen=True, slots=True)
class MaxRow:
    mode: str
    direct_rps: float
    through_rps: float
    gateway_cpu_percent: float
    cpu_ms_per_request: float
    core_busy_percent: float  # the gateway's CPU, busy with anything: above the gateway's own share = contention
    harness_cpu_percent: float  # load generator + simulated upstreams, during the through runs

    @property
    def limited_by(self) -> str:
        if self.gateway_cpu_percent >= SATURATED_PERCENT:
            return "gateway (its CPU is saturated)"
        if self.core_busy_percent >= SATURATED_PERCENT:
            return "other processes on the gateway's CPU"
        if self.harness_cpu_percent >= SATURATED_PERCENT:
            return "load generator + upstreams (their CPU is saturated)"
        return "neither CPU saturated: latency-bound"


@dataclass(frozen=True, slots=True)
class Check:
    figure: str
    goal: str
    value: float
    unit: str
    met: bool


@dataclass(frozen=True, slots=True)
class Report:
    options: BenchOptions
    date: str
    machine: str
    placement: str
    seconds: float
    ttft: list[Row]
    gaps: list[GapRow]
    plain: list[Row]
    maxima: list[MaxRow]
    peak_rss_mb: float
    through_requests: int
    through_with_overhead: int
    direct_with_overhead: int
    errors: int
    others_percent: float
    tcp: tuple[int, int]
    checks: list[Check]

    def markdown(self) -> str:
        return render(self)


# Child processes


@dataclass(frozen=True, slots=True)
class Placement:
    gateway_cpu: int | None
    harness_cpu: int | None
    note: str


@dataclass(slots=True)
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    log: IO[bytes]

    def cpu_seconds(self) -> float:
        data = Path(f"/proc/{self.popen.pid}/stat").read_bytes()
        fields = data[data.rindex(b")") + 2 :].split()  # the name may hold spaces; fields[0] is field 3
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def peak_rss_mb(self) -> float:
        for line in Path(f"/proc/{self.popen.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
        return math.nan

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-2000:].strip()

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self.log.close()


@dataclass(frozen=True, slots=True)
class Fleet:
    paced: Child
    fast: Child
    gateway: Child
    ports: dict[str, int]
    gateway_cpu: int | None

    def harness_cpu_seconds(self) -> float:
        return time.process_time() + self.paced.cpu_seconds() + self.fast.cpu_seconds()

    def ours_cpu_seconds(self) -> float:
        return self.harness_cpu_seconds() + self.gateway.cpu_seconds()

    def core_busy_seconds(self) -> float:
        """Busy time of the gateway's CPU (unpinned: of an average CPU), whoever used it."""
        if self.gateway_cpu is None:
            return busy_seconds("cpu") / (os.cpu_count() or 1)
        return busy_seconds(f"cpu{self.gateway_cpu}")


def machine_meters(fleet: Fleet) -> tuple[float, float, float, float, float]:
    """(wall time, CPU time busy machine-wide, ours, TCP segments retransmitted, TCP retransmission timeouts)."""
    retransmits = proc_net_counter("/proc/net/snmp", "Tcp:", "RetransSegs")
    timeouts = proc_net_counter("/proc/net/netstat", "TcpExt:", "TCPTimeouts")
    return time.perf_counter(), busy_seconds("cpu"), fleet.ours_cpu_seconds(), retransmits, timeouts


def proc_net_counter(path: str, prefix: str, name: str) -> float:
    with contextlib.suppress(OSError, ValueError, IndexError):
        header, values = [line.split() for line in Path(path).read_text().splitlines() if line.startswith(prefix)][:2]
        return float(values[header.index(name)])
    return 0.0


def busy_seconds(name: str) -> float:
    """A /proc/stat line's time not idle; steal counts as busy, since the CPU was not ours then."""
    for line in Path("/proc/stat").read_text().splitlines():
        fields = line.split()
        if fields[0] == name:
            ticks = [int(value) for value in fields[1:9]]  # user nice system idle iowait irq softirq steal
            return (sum(ticks) - ticks[3] - ticks[4]) / CLK_TCK
    return math.nan


def placement(pin: bool) -> Placement:
    cpus = sorted(os.sched_getaffinity(0))
    if not pin:
        return Placement(None, None, "unpinned (pinning turned off)")
    if shutil.which("taskset") is None:
        return Placement(None, None, "unpinned: taskset not found, so all processes share every CPU")
    if len(cpus) < 2:
        return Placement(None, None, "unpinned: fewer than two CPUs available")
    gw, harness = cpus[0], cpus[1]
    return Placement(gw, harness, f"gateway on CPU {gw}; upstreams and load generator on CPU {harness} (taskset)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def spawn(name: str, args: list[str], cpu: int | None, env: dict[str, str]) -> Child:
    prefix = ["taskset", "-c", str(cpu)] if cpu is not None else []
    log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the child; Child.stop closes it
    command = [*prefix, sys.executable, "-m", "gateway.cli", *args]
    popen = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, env=env)
    return Child(name, popen, log)


def start_fleet(options: BenchOptions, where: Placement, scenario: Path) -> Fleet:
    ports = {"paced": free_port(), "fast": free_port(), "gateway": free_port()}
    env = {**os.environ, "SIM_PACED_PORT": str(ports["paced"]), "SIM_FAST_PORT": str(ports["fast"])}
    children: list[Child] = []
    try:
        for name, tpot, tokens in (("paced", options.tpot_ms, options.tokens), ("fast", 0.0, options.tokens)):
            sim = ["sim", "--port", str(ports[name]), "--ttft-ms", "0", "--tpot-ms", f"{tpot:g}", "--tokens"]
            children.append(spawn(f"sim {name}", [*sim, str(tokens)], where.harness_cpu, env))
        serve = ["serve", "-c", str(scenario), "--port", str(ports["gateway"]), "--log-level", "warning"]
        children.append(spawn("gateway", serve, where.gateway_cpu, env))
    except BaseException:
        for child in children:
            child.stop()
        raise
    return Fleet(children[0], children[1], children[2], ports, where.gateway_cpu)


def scenario_path(path: str | None) -> Path:
    found = Path(path) if path else SCENARIO
    if path is None and not found.exists():
        found = Path(__file__).resolve().parents[2] / SCENARIO
    if not found.exists():
        raise BenchError(f"scenario not found: {found}")
    return found.resolve()


# Requests


def workload(model: str, stream: bool, tokens: int) -> Workload:
    if stream:
        bodies = [{"model": model, "prompt": p, "max_tokens": tokens, "stream": True} for p in PROMPTS]
        return Workload(STREAM_PATH, tuple(orjson.dumps(b) for b in bodies), True)
    chats = [{"model": model, "messages": [{"role": "user", "content": p}], "max_tokens": tokens} for p in PROMPTS]
    return Workload(PLAIN_PATH, tuple(orjson.dumps(b) for b in chats), False)


def record_own(headers: list[tuple[bytes, bytes]], out: Samples) -> None:
    for name, value in headers:
        if name == OVERHEAD_HEADER:
            out.own.append(float(value))
            return


async def once(pool: Pool, work: Workload, index: int, out: Samples) -> None:
    """One request; its figures go to `out`, a failure counts as an error."""
    body = work.bodies[index % len(work.bodies)]
    started = time.perf_counter()
    first = last = 0.0
    try:
        response = await pool.request(b"POST", work.path, HEADERS, body)
        try:
            if work.stream:
                while chunk := await response.next_chunk():
                    if TOKEN.search(chunk):
                        now = time.perf_counter()
                        if first:
                            out.gaps.append((now - last) * 1000.0)
                        else:
                            first = now
                        last = now
            else:
                first = time.perf_counter() if TOKEN.search(await response.read()) else 0.0
        finally:
            response.close()
    except PoolError:
        out.errors += 1
        return
    if response.status != 200 or not first:
        out.errors += 1
        return
    out.latency.append((first - started) * 1000.0)
    record_own(response.headers, out)


async def prime(pool: Pool, work: Workload, concurrency: int) -> None:
    """Open and warm as many connections as a cell may need, on both hops, before it is timed."""
    scratch = Samples()
    await asyncio.gather(*(once(pool, work, i, scratch) for i in range(concurrency)))


def cell_count(options: BenchOptions, rate: float) -> int:
    return max(options.min_requests, min(options.max_requests, round(rate * options.cell_seconds)))


async def open_loop(options: BenchOptions, pool: Pool, work: Workload, rate: float) -> Samples:
    """Requests sent on a fixed schedule, whatever the answers do (no coordinated omission)."""
    await prime(pool, work, options.concurrency)
    out = Samples()
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = []
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        for i in range(cell_count(options, rate)):
            wait = start + i / rate - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(loop.create_task(once(pool, work, i, out)))
        await asyncio.gather(*tasks)
    finally:
        gc.enable()
    return out


async def closed_loop(options: BenchOptions, pool: Pool, work: Workload, fleet: Fleet) -> Run:
    """`concurrency` connections each sending back to back; only the window after the warm-up counts."""
    out = Samples()
    stop = asyncio.Event()

    async def worker(index: int) -> None:
        while not stop.is_set():
            await once(pool, work, index, out)
            index += options.concurrency

    gc.collect()
    gc.disable()
    try:
        tasks = [asyncio.get_running_loop().create_task(worker(i)) for i in range(options.concurrency)]
        await asyncio.sleep(options.max_warmup_seconds)
        before = (time.perf_counter(), len(out.latency), *cpu_meters(fleet))
        await asyncio.sleep(options.max_seconds)
        after = (time.perf_counter(), len(out.latency), *cpu_meters(fleet))
        stop.set()
        await asyncio.gather(*tasks)
    finally:
        gc.enable()
    seconds, requests, gateway, core, harness = (b - a for a, b in zip(before, after, strict=True))
    return Run(seconds, round(requests), gateway, core, harness, out)


def cpu_meters(fleet: Fleet) -> tuple[float, float, float]:
    return fleet.gateway.cpu_seconds(), fleet.core_busy_seconds(), fleet.harness_cpu_seconds()


async def wait_ready(child: Child, pool: Pool, path: bytes, deadline: float) -> None:
    while True:
        if child.popen.poll() is not None:
            raise BenchError(f"{child.name} exited with status {child.popen.returncode}: {child.output()}")
        with contextlib.suppress(PoolError):
            response = await pool.request(b"GET", path, b"", b"")
            await response.read()
            if response.status == 200:
                return
        if time.monotonic() > deadline:
            raise BenchError(f"{child.name} not ready within the start-up timeout: {child.output()}")
        await asyncio.sleep(0.05)


async def measure(options: BenchOptions, fleet: Fleet) -> Results:
    def pool(name: str) -> Pool:
        return Pool(f"http://127.0.0.1:{fleet.ports[name]}", CLIENT_LIMITS)

    gateway = pool("gateway")
    direct = Side("direct", pool("paced"), pool("fast"))
    through = Side("through", gateway, gateway)
    try:
        deadline = time.monotonic() + 30.0
        await wait_ready(fleet.paced, direct.paced, b"/health", deadline)
        await wait_ready(fleet.fast, direct.fast, b"/health", deadline)
        await wait_ready(fleet.gateway, gateway, b"/readyz", deadline)
        results = Results()
        before = machine_meters(fleet)
        for number in range(options.rounds):
            await measure_round(options, (direct, through) if number % 2 == 0 else (through, direct), fleet, results)
        wall, busy, ours, retransmits, timeouts = (b - a for a, b in zip(before, machine_meters(fleet), strict=True))
        results.others_percent = 100.0 * max(busy - ours, 0.0) / (wall * (os.cpu_count() or 1))
        results.tcp = (round(retransmits), round(timeouts))
        return results
    finally:
        for client in (direct.paced, direct.fast, gateway):
            await client.aclose()


async def measure_round(options: BenchOptions, sides: tuple[Side, Side], fleet: Fleet, results: Results) -> None:
    paced = workload("paced", True, options.tokens)
    plain = workload("fast", False, options.plain_tokens)
    flood = workload("fast", True, options.tokens)
    for kind, work in (("ttft", paced), ("plain", plain)):
        for rate in options.rates:
            for side in sides:
                target = side.paced if work is paced else side.fast
                samples = await open_loop(options, target, work, rate)
                results.cells.setdefault((kind, rate, side.name), []).append(samples)
    for mode, work in (("non-stream", plain), ("stream", flood)):
        for side in sides:
            run = await closed_loop(options, side.fast, work, fleet)
            results.runs.setdefault((mode, side.name), []).append(run)


# Figures


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def pooled(rounds: list[list[float]]) -> list[float]:
    return [value for values in rounds for value in values]


def dist(rounds: list[list[float]]) -> Dist:
    values = pooled(rounds)
    medians = [percentile(r, 0.5) for r in rounds if r]
    return Dist(statistics.median(medians) if medians else math.nan, percentile(values, 0.99), len(values))


def latency_row(rate: float, direct: list[Samples], through: list[Samples]) -> Row:
    d, t = dist([s.latency for s in direct]), dist([s.latency for s in through])
    added = [percentile(b.latency, 0.5) - percentile(a.latency, 0.5) for a, b in zip(direct, through, strict=True)]
    own = pooled([s.own for s in through])
    own_dist = Dist(percentile(own, 0.5), percentile(own, 0.99), len(own))
    return Row(rate, d, t, statistics.median(added), t.p99 - d.p99, own_dist)


def gap_row(rate: float, direct: list[Samples], through: list[Samples]) -> GapRow:
    d, t = pooled([s.gaps for s in direct]), pooled([s.gaps for s in through])
    mean_d = statistics.fmean(d) if d else math.nan
    mean_t = statistics.fmean(t) if t else math.nan
    return GapRow(rate, mean_d, mean_t, percentile(d, 0.99), percentile(t, 0.99), len(t))


def max_row(mode: str, direct: list[Run], through: list[Run]) -> MaxRow:
    seconds = sum(r.seconds for r in through)
    requests = sum(r.requests for r in through)
    cpu = sum(r.gateway_cpu_s for r in through)
    return MaxRow(
        mode,
        statistics.median(r.requests / r.seconds for r in direct),
        statistics.median(r.requests / r.seconds for r in through),
        100.0 * cpu / seconds,
        1000.0 * cpu / requests if requests else math.nan,
        100.0 * sum(r.core_busy_s for r in through) / seconds,
        100.0 * sum(r.harness_cpu_s for r in through) / seconds,
    )


def check(figure: str, value: float, limit: float, unit: str, at_least: bool = False) -> Check:
    goal = f"{'≥' if at_least else '≤'} {limit:,g} {unit}"
    return Check(figure, goal, value, unit, value >= limit if at_least else value <= limit)


def checks(ttft: list[Row], gaps: list[GapRow], maxima: list[MaxRow]) -> list[Check]:
    found = [
        check(f"stream TTFT added, p50 @{row.rate:g} req/s", row.added_p50, TARGET_TTFT_MS, "ms")
        for row in ttft
        if row.rate in (50.0, 200.0)
    ]
    plain = maxima[0]
    worst = max(gaps, key=lambda g: g.added_mean)
    return [
        *found,
        check("max non-stream req/s, one worker", plain.through_rps, TARGET_RPS, "req/s", at_least=True),
        check("gateway CPU per non-stream request at max", plain.cpu_ms_per_request, TARGET_CPU_MS, "ms"),
        check(f"gap between chunks added, mean (worst: @{worst.rate:g} req/s)", worst.added_mean, TARGET_GAP_MS, "ms"),
    ]


def build_report(options: BenchOptions, results: Results, context: dict[str, Any]) -> Report:
    def cells(kind: str, rate: float) -> tuple[list[Samples], list[Samples]]:
        return results.cells[(kind, rate, "direct")], results.cells[(kind, rate, "through")]

    ttft = [latency_row(rate, *cells("ttft", rate)) for rate in options.rates]
    gaps = [gap_row(rate, *cells("ttft", rate)) for rate in options.rates]
    plain = [latency_row(rate, *cells("plain", rate)) for rate in options.rates]
    maxima = [max_row(m, results.runs[(m, "direct")], results.runs[(m, "through")]) for m in ("non-stream", "stream")]
    through, direct = results.all_samples("through"), results.all_samples("direct")
    return Report(
        options=options,
        date=context["date"],
        machine=context["machine"],
        placement=context["placement"],
        seconds=context["seconds"],
        ttft=ttft,
        gaps=gaps,
        plain=plain,
        maxima=maxima,
        peak_rss_mb=context["rss"],
        through_requests=sum(len(s.latency) for s in through),
        through_with_overhead=sum(len(s.own) for s in through),
        direct_with_overhead=sum(len(s.own) for s in direct),
        errors=sum(s.errors for s in through + direct),
        others_percent=results.others_percent,
        tcp=results.tcp,
        checks=checks(ttft, gaps, maxima),
    )


# Running and reporting


def machine() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load = os.getloadavg()[0]
    return (
        f"{len(os.sched_getaffinity(0))} CPUs ({model}), Linux {platform.release()}, "
        f"Python {platform.python_version()}; load average {load:.2f} at the start"
    )


def run_loop(options: BenchOptions, fleet: Fleet) -> Results:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - platforms without uvloop
        return asyncio.run(measure(options, fleet))
    results: Results = uvloop.run(measure(options, fleet))
    return results


def run(options: BenchOptions) -> Report:
    """Start the upstreams and the gateway, measure, stop them all, and return the figures."""
    started = time.perf_counter()
    where = placement(options.pin)
    scenario = scenario_path(options.scenario)
    context: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "placement": where.note,
    }
    affinity = os.sched_getaffinity(0)
    fleet = start_fleet(options, where, scenario)
    try:
        if where.harness_cpu is not None:
            os.sched_setaffinity(0, {where.harness_cpu})
        gc.collect()
        gc.freeze()  # start-up objects need no more collecting: keeps collector pauses out of the timings
        results = run_loop(options, fleet)
        context["rss"] = fleet.gateway.peak_rss_mb()
    finally:
        gc.unfreeze()
        os.sched_setaffinity(0, affinity)
        for child in (fleet.gateway, fleet.paced, fleet.fast):
            child.stop()
    context["seconds"] = time.perf_counter() - started
    return build_report(options, results, context)


def ms(value: float, digits: int = 2) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def render(report: Report) -> str:
    o = report.options
    rates = " / ".join(f"{r:g}" for r in o.rates)
    counts = ", ".join(f"{cell_count(o, r)} @{r:g}" for r in o.rates)
    lines = [
        "# Sluice overhead benchmark",
        "",
        f"- Command: `{o.command or command_line()}`",
        f"- Date: {report.date}; the run took {report.seconds:.0f} s",
        f"- Machine: {report.machine}",
        f"- Placement: {report.placement}",
        f"- Method: {o.rounds} round(s), direct and through interleaved, order swapped every round; open-loop "
        f"arrivals evenly spaced; requests per cell and side: {counts}; upstream `paced` streams {o.tokens} tokens "
        f"{o.tpot_ms:g} ms apart (TTFT = first SSE event carrying a token), `fast` answers at once "
        f"({o.plain_tokens}-token replies); closed loops use {o.concurrency} connections for "
        f"{o.max_seconds:g} s per round after {o.max_warmup_seconds:g} s of warm-up. Added p50 = median over rounds "
        "of (through p50 - direct p50); p99 from all rounds' samples. Times in ms.",
        "",
        "## Targets",
        "",
        "| figure | target | measured | met |",
        "|---|---|---|---|",
        *(
            f"| {c.figure} | {c.goal} | {c.value:,.2f} {c.unit} | {'yes' if c.met else '**no**'} |"
            for c in report.checks
        ),
        "",
        "## Summary (the peers' columns)",
        "",
        f"| system | stream TTFT added, p50 ms @{rates} rps | non-stream added, p50 ms @{rates} rps | "
        "max req/s non-stream / stream (one core) | CPU ms per request at max, non-stream / stream | peak RSS MB |",
        "|---|---|---|---|---|---|",
        summary_direct(report),
        summary_gateway(report),
        "",
        "## Streaming TTFT",
        "",
        *latency_table(report.ttft),
        "",
        "## Gaps between streamed token chunks",
        "",
        "| rate | direct mean | through mean | added mean | direct p99 | through p99 | added p99 | gaps (through) |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {g.rate:g} | {ms(g.direct_mean, 3)} | {ms(g.through_mean, 3)} | {ms(g.added_mean, 3)} | "
            f"{ms(g.direct_p99)} | {ms(g.through_p99)} | {ms(g.added_p99)} | {g.count} |"
            for g in report.gaps
        ),
        "",
        "## Non-streaming latency",
        "",
        *latency_table(report.plain),
        "",
        f"## Max throughput (closed loop, {o.concurrency} connections)",
        "",
        "| mode | direct req/s | through req/s | gateway CPU % | gateway CPU ms per request "
        "| gateway's CPU busy, all processes % | load generator + upstreams CPU % | limited by |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {m.mode} | {m.direct_rps:,.0f} | {m.through_rps:,.0f} | {m.gateway_cpu_percent:.0f} | "
            f"{ms(m.cpu_ms_per_request, 3)} | {m.core_busy_percent:.0f} | {m.harness_cpu_percent:.0f} | "
            f"{m.limited_by} |"
            for m in report.maxima
        ),
        "",
        "## Notes",
        "",
        *notes(report),
    ]
    return "\n".join(lines) + "\n"


def latency_table(rows: list[Row]) -> list[str]:
    head = [
        "| rate | requests per side | direct p50 | through p50 | added p50 | direct p99 | through p99 | added p99 "
        "| gateway's own view (x-sluice-overhead-ms) p50 / p99 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    return head + [
        f"| {r.rate:g} | {r.through.count} | {ms(r.direct.p50)} | {ms(r.through.p50)} | {ms(r.added_p50)} | "
        f"{ms(r.direct.p99)} | {ms(r.through.p99)} | {ms(r.added_p99)} | {ms(r.own.p50)} / {ms(r.own.p99)} |"
        for r in rows
    ]


def summary_direct(report: Report) -> str:
    ttft = " / ".join(ms(r.direct.p50) for r in report.ttft)
    plain = " / ".join(ms(r.direct.p50) for r in report.plain)
    rps = " / ".join(f"{m.direct_rps:,.0f}" for m in report.maxima)
    return f"| direct (the limit) | 0 (absolute {ttft}) | 0 (absolute {plain}) | {rps} | - | - |"


def summary_gateway(report: Report) -> str:
    ttft = " / ".join(ms(r.added_p50) for r in report.ttft)
    plain = " / ".join(ms(r.added_p50) for r in report.plain)
    rps = " / ".join(f"{m.through_rps:,.0f}" for m in report.maxima)
    cpu = " / ".join(ms(m.cpu_ms_per_request, 3) for m in report.maxima)
    return f"| sluice, one worker | {ttft} | {plain} | {rps} | {cpu} | {report.peak_rss_mb:.0f} |"


def notes(report: Report) -> list[str]:
    top = report.ttft[-1]
    keeps_up = (
        "sub-millisecond: the load generator keeps up"
        if top.direct.p50 < 1.0
        else "NOT sub-millisecond: the load generator or the upstream is slow, so the added figures are unreliable"
    )
    found = [
        f"- Through-gateway responses carrying `x-sluice-overhead-ms`: {report.through_with_overhead} of "
        f"{report.through_requests}; direct responses carrying it: {report.direct_with_overhead}.",
        f"- Failed requests: {report.errors}.",
        f"- Load generator check: direct TTFT p50 at {top.rate:g} req/s is {ms(top.direct.p50)} ms ({keeps_up}).",
        "- The gateway's own view counts its time up to the response head; the outside view adds the network hops "
        "and the relay of the first token.",
        "- p99 on a small VM is dominated by CPU wake-ups and cross-CPU hops: compare p50s across runs, p99s only "
        "within one run.",
    ]
    found.append(
        f"- TCP on the whole machine during the measurement: {report.tcp[0]} segments retransmitted, "
        f"{report.tcp[1]} retransmission timeouts (each stalls a connection for 200 ms or more: it shows in p99)."
    )
    if report.others_percent >= 5.0:
        found.append(
            f"- Other processes used {report.others_percent:.0f} % of the machine's CPU time during the "
            "measurement: the figures are noisy, re-run on a quiet machine."
        )
    for row in report.maxima:
        if row.gateway_cpu_percent < SATURATED_PERCENT:
            found.append(
                f"- {row.mode} max: the gateway used {row.gateway_cpu_percent:.0f} % of a CPU, so it was "
                f"not saturated ({row.limited_by}); {row.through_rps:,.0f} req/s is a lower bound."
            )
    if not report.placement.startswith("gateway on CPU"):
        found.append("- Processes were not pinned: the gateway, upstreams and load generator compete for CPUs.")
    return found


def command_line() -> str:
    argv = sys.argv
    if Path(argv[0]).name == "sluice":
        return shlex.join(["sluice", *argv[1:]])
    if argv[0].endswith("bench.py"):
        return shlex.join(["python", "-m", "gateway.tools.bench", *argv[1:]])
    return shlex.join(argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="one short round (about 30 s)")
    parser.add_argument("--smoke", action="store_true", help="tiny counts, unpinned: checks that it all runs")
    parser.add_argument("--rounds", type=int, help="rounds of direct/through cells (default 3)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the processes to CPUs")
    parser.add_argument("--scenario", help=f"gateway config (default {SCENARIO})")
    parser.add_argument("--write", metavar="PATH", help="also write the markdown report to PATH")


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    base = SMOKE if args.smoke else QUICK if args.quick else DEFAULT
    return replace(
        base,
        rounds=args.rounds or base.rounds,
        pin=base.pin and not args.no_pin,
        scenario=args.scenario,
        write=args.write,
        command=command_line(),
    )


def main(options: BenchOptions | argparse.Namespace) -> int:
    """Run, print the report, write it with --write; 0 when every request succeeded."""
    if isinstance(options, argparse.Namespace):
        options = options_from_args(options)
    try:
        report = run(options)
    except BenchError as exc:
        print(f"sluice bench: {exc}", file=sys.stderr)
        return 2
    text = report.markdown()
    print(text, end="")
    if options.write:
        Path(options.write).write_text(text)
    return 0 if report.errors == 0 else 1


if __name__ == "__main__":
    cli = argparse.ArgumentParser(prog="sluice bench", description="Gateway overhead against a direct upstream.")
    add_arguments(cli)
    sys.exit(main(cli.parse_args()))
