"""The `workers` scenario: one `sluice serve` process, two workers, and two one-worker gateways, side by side.

The bare gateway (`scenarios/overhead.yaml`) runs three ways at once: `--workers 1`; `--workers 2`; and, as
the control, two separate `--workers 1` gateways that share the load between them as the two workers do.
Each is sent the same open-loop rate of non-streaming requests, all on one schedule whose slots take the
three in a shuffled turn, so whatever else the machine does falls on all three alike. Every process is
unpinned (they share both CPUs with the simulated upstreams and this load generator).

A gateway's cost is the CPU time of its whole process tree (the supervisor and its workers) from /proc,
divided by the requests sent to it. Its load arrives on 32 client connections that take turns, as 32 clients
would: a single keep-alive pool at this rate reuses one or two connections, which would keep one worker
busy and the other idle. Why the control: a process serving half the requests spends more CPU on each
(measured here, a lone worker at 500 req/s spends 10-20 % more per request than at 1,000, and this load
generator's own CPU per request rises alike: caches and idle CPUs are colder between requests), so one worker
against two measures the split as much as the workers. Two workers against two one-worker gateways at the
same split is what `--workers` itself costs (the supervisor, the metrics shared between workers); one worker
against two is reported beside it. Before the load, every process must have gone idle (a worker still
starting would count its imports), and after it one scrape of /metrics must count every request sent.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from pathlib import Path

from gateway.upstream.pool import Pool
from tools.bench.figures import Check, check, ms
from tools.bench.fleet import CLK_TCK, Child, bench_file, free_port, python_module, spawn, start_sim
from tools.bench.load import CLIENT_LIMITS, Lane, get, interleaved, wait_ready, workload
from tools.bench.rig import CORE_CONFIG, START_TIMEOUT_S, BenchOptions

NAME = "workers"
ONE, TWO, PAIR = "1 worker", "2 workers", "2 separate 1-worker gateways"
TARGET_RATIO = 1.10  # CPU per request with two workers, over two one-worker gateways sharing the same load
CLIENTS = 32  # connections per gateway, taking turns
IDLE_CPU = 0.02  # of a core: a process tree below this has finished starting
RATES = {"default": (1000.0, 10.0), "quick": (1000.0, 4.0), "smoke": (100.0, 1.0)}  # preset -> (req/s, seconds)


@dataclass(frozen=True, slots=True)
class Served:
    name: str
    processes: int  # in the gateway's process trees while it ran
    sent: int
    answered: int
    cpu_s: float  # of the whole trees, during the load
    seconds: float
    counted: int  # sluice_requests_total summed over its series, from one scrape of each gateway afterwards
    shares: tuple[float, ...]  # each busy process's part of the CPU (the workers', with two)

    @property
    def cpu_ms_per_request(self) -> float:
        return 1000.0 * self.cpu_s / self.sent if self.sent else math.nan


@dataclass(frozen=True, slots=True)
class Workers:
    rate: float
    runs: dict[str, Served]
    errors: int

    def over(self, name: str) -> float:
        one, two = self.runs[name].cpu_ms_per_request, self.runs[TWO].cpu_ms_per_request
        return two / one if one else math.nan

    @property
    def ratio(self) -> float:
        """Two workers over two one-worker gateways: what `--workers` costs."""
        return self.over(PAIR)


def tree(pid: int) -> list[int]:
    """`pid` and every process descending from it (uvicorn's workers, multiprocessing's helpers)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            data = (entry / "stat").read_bytes()
        except OSError:  # gone meanwhile
            continue
        ppid = int(data[data.rindex(b")") + 2 :].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += parents.get(current, [])
    return found


def cpu_seconds(pids: list[int]) -> float:
    return sum(each_cpu_seconds(pids))


def each_cpu_seconds(pids: list[int]) -> list[float]:
    found = []
    for pid in pids:
        try:
            data = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            found.append(0.0)
            continue
        fields = data[data.rindex(b")") + 2 :].split()
        found.append((int(fields[11]) + int(fields[12])) / CLK_TCK)
    return found


def counted(exposition: str) -> int:
    """Requests counted by the gateway: the sum of every `sluice_requests_total` series."""
    total = 0.0
    for line in exposition.splitlines():
        if line.startswith("sluice_requests_total{") or line.startswith("sluice_requests_total "):
            total += float(line.rsplit(" ", 1)[1])
    return round(total)


@dataclass(slots=True)
class Gateway:
    """One `sluice serve`, the client connections that take turns on it, and its process tree."""

    child: Child
    port: int
    clients: list[Pool]
    pids: list[int]

    @classmethod
    def start(cls, env: dict[str, str], workers: int) -> Gateway:
        port = free_port()
        args = ["serve", "-c", str(bench_file(CORE_CONFIG)), "--port", str(port), "--log-level", "warning"]
        child = spawn(
            f"gateway {workers} worker(s)", python_module("gateway.cli", *args, "--workers", str(workers)), None, env
        )
        return cls(child, port, [], [])

    async def ready(self, deadline: float, clients: int) -> None:
        pool = Pool(f"http://127.0.0.1:{self.port}", CLIENT_LIMITS)
        try:
            await wait_ready(self.child, pool, b"/readyz", deadline)
        finally:
            await pool.aclose()
        self.clients = [Pool(f"http://127.0.0.1:{self.port}", CLIENT_LIMITS) for _ in range(clients)]

    async def idle(self, deadline: float) -> None:
        """Until the whole tree has gone idle: every worker started, warm-up done."""
        while True:
            self.pids = tree(self.child.popen.pid)
            before = cpu_seconds(self.pids)
            await asyncio.sleep(0.5)
            if cpu_seconds(self.pids) - before <= IDLE_CPU * 0.5 + 1.0 / CLK_TCK or time.monotonic() > deadline:
                return

    async def counted(self) -> int:
        status, body = await get(self.clients[0], b"/metrics")
        return counted(body.decode()) if status == 200 else 0

    async def aclose(self) -> None:
        for pool in self.clients:
            await pool.aclose()
        self.child.stop()


async def measure(options: BenchOptions, env: dict[str, str]) -> Workers:
    """Both upstreams of the core config run (it names both); only `fast` is sent to."""
    rate, seconds = RATES.get(options.preset, RATES["default"])
    ports = {"paced": free_port(), "fast": free_port()}
    env = {**env, "SIM_PACED_PORT": str(ports["paced"]), "SIM_FAST_PORT": str(ports["fast"])}
    sims: list[Child] = []
    targets: dict[str, list[Gateway]] = {}
    try:
        for name in ports:
            sims.append(start_sim(name, ports[name], options.tpot_ms if name == "paced" else 0.0, 20, None, env))
        targets = {ONE: [Gateway.start(env, 1)], TWO: [Gateway.start(env, 2)], PAIR: []}
        targets[PAIR] = [Gateway.start(env, 1), Gateway.start(env, 1)]
        deadline = time.monotonic() + START_TIMEOUT_S
        for group in targets.values():
            for gateway in group:
                await gateway.ready(deadline, CLIENTS // len(group))
        for gateway in (g for group in targets.values() for g in group):
            await gateway.idle(deadline)
        return await load(targets, rate, max(options.min_requests, round(rate * seconds)))
    finally:
        for gateway in (g for group in targets.values() for g in group):
            await gateway.aclose()
        for sim in sims:
            sim.stop()


async def load(targets: dict[str, list[Gateway]], rate: float, count: int) -> Workers:
    """`rate` req/s to each target, its clients taking turns, the targets' turns shuffled within each slot."""
    work = workload("fast", False, 5)
    lanes: list[tuple[str, Lane]] = []
    for name, group in targets.items():
        # A pair's gateways alternate, so that each gets half, as the two workers of one gateway do.
        ordered = [group[i % len(group)].clients[i // len(group)] for i in range(CLIENTS)]
        lanes += [(name, Lane(pool, work, work)) for pool in ordered]
    per_lane = max(1, count // CLIENTS)
    pids = {name: [pid for gateway in group for pid in gateway.pids] for name, group in targets.items()}
    before = {name: each_cpu_seconds(found) for name, found in pids.items()}
    started = time.perf_counter()
    outs = await interleaved([lane for _, lane in lanes], rate / CLIENTS, per_lane, 1)
    wall = time.perf_counter() - started
    spent = {
        name: [b - a for a, b in zip(before[name], each_cpu_seconds(found), strict=True)]
        for name, found in pids.items()
    }
    runs: dict[str, Served] = {}
    errors = 0
    for name, group in targets.items():
        samples = [out for (lane_name, _), out in zip(lanes, outs, strict=True) if lane_name == name]
        answered = sum(len(out.latency) for out in samples)
        sent = per_lane * CLIENTS + CLIENTS  # each client is primed with one request first
        errors += per_lane * CLIENTS - answered
        total = sum(spent[name])
        busy = [cpu for cpu in spent[name] if cpu > 0.1 * total / max(len(group), 1)] if total > 0 else []
        shares = tuple(cpu / total for cpu in busy) if len(busy) > 1 else ()
        found = sum([await gateway.counted() for gateway in group])
        runs[name] = Served(name, len(pids[name]), sent, answered, total, wall, found, shares)
    return Workers(rate, runs, errors)


def checks(w: Workers) -> list[Check]:
    found = [
        # The target as set: two workers against one serving the same total rate. The control beside it tells
        # what of that is `--workers` itself and what is each process serving half the rate.
        check(NAME, "CPU per request, 2 workers over 1 worker, same total rate", w.over(ONE), TARGET_RATIO, "x"),
        check(NAME, "CPU per request, 2 workers over 2 one-worker gateways", w.ratio, TARGET_RATIO, "x"),
    ]
    for name, run in w.runs.items():
        found.append(check(NAME, f"requests missing from /metrics, {name}", abs(run.sent - run.counted), 0, ""))
    return found


def render(w: Workers) -> list[str]:
    lines = [
        "## Workers: one process and two",
        "",
        f"`overhead.yaml` served three ways at once: `--workers 1`, `--workers 2`, and two separate `--workers 1` "
        f"gateways sharing the load (the control); each sent {w.rate:,.0f} non-streaming req/s (open loop) on "
        f"{CLIENTS} client connections taking turns, the three's turns shuffled within one schedule; unpinned. CPU "
        "is each one's whole process tree (supervisor and workers) from /proc; `counted` is `sluice_requests_total` "
        "from one scrape of each gateway afterwards.",
        "",
        "| gateway | processes | sent | answered | s | tree CPU s | CPU ms per request | busy processes' shares | "
        "counted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in w.runs.items():
        shares = " / ".join(f"{100 * s:.0f} %" for s in r.shares) or "one"
        lines.append(
            f"| {name} | {r.processes} | {r.sent:,} | {r.answered:,} | {r.seconds:.1f} | {r.cpu_s:.2f} "
            f"| {ms(r.cpu_ms_per_request, 3)} | {shares} | {r.counted:,} |"
        )
    lines += [
        "",
        f"- CPU per request with two workers: {w.ratio:.2f} x two one-worker gateways' at the same split "
        f"(target ≤ {TARGET_RATIO:g}: what `--workers` itself costs); {w.over(ONE):.2f} x one worker's serving "
        f"it all, which includes what halving each process's rate costs on this machine "
        f"({w.runs[PAIR].cpu_ms_per_request / w.runs[ONE].cpu_ms_per_request:.2f} x for the two one-worker gateways).",
    ]
    return lines
