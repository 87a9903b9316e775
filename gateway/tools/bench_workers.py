"""The `workers` scenario: one `sluice serve` process against two workers, at the same total rate.

The bare gateway (`scenarios/overhead.yaml`) is served with `--workers 1` and then `--workers 2`, every
process unpinned (the workers share both CPUs with the simulated upstream and this load generator), and
sent the same open-loop rate of non-streaming requests. The gateway's cost is the CPU time of its whole
process tree, the uvicorn supervisor and its workers, read from /proc before and after the load; divided by
the requests sent it is the CPU per request, which a second worker should leave within 10 %. After the
load, one scrape of /metrics must count every request sent: the workers' counters are summed (Prometheus
multiprocess mode), whichever worker answers the scrape.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from gateway.pool import Pool
from gateway.tools.bench_figures import Check, check, ms
from gateway.tools.bench_fleet import CLK_TCK, Child, bench_file, free_port, python_module, spawn, start_sim
from gateway.tools.bench_load import CLIENT_LIMITS, get, open_loop, wait_ready, workload
from gateway.tools.bench_rig import CORE_CONFIG, START_TIMEOUT_S, BenchOptions

NAME = "workers"
WORKERS = (1, 2)
TARGET_RATIO = 1.10  # CPU per request with two workers, over one worker's
RATES = {"default": (1000.0, 10.0), "quick": (1000.0, 4.0), "smoke": (100.0, 1.0)}  # preset -> (req/s, seconds)


@dataclass(frozen=True, slots=True)
class Served:
    workers: int
    processes: int  # in the gateway's process tree while it ran
    sent: int
    answered: int
    cpu_s: float  # of the whole tree, during the load
    seconds: float
    counted: int  # sluice_requests_total summed over its series, from one scrape afterwards

    @property
    def cpu_ms_per_request(self) -> float:
        return 1000.0 * self.cpu_s / self.sent if self.sent else math.nan


@dataclass(frozen=True, slots=True)
class Workers:
    rate: float
    runs: dict[int, Served]
    errors: int

    @property
    def ratio(self) -> float:
        one, two = self.runs[1].cpu_ms_per_request, self.runs[2].cpu_ms_per_request
        return two / one if one else math.nan


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
    total = 0
    for pid in pids:
        try:
            data = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            continue
        fields = data[data.rindex(b")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def counted(exposition: str) -> int:
    """Requests counted by the gateway: the sum of every `sluice_requests_total` series."""
    total = 0.0
    for line in exposition.splitlines():
        if line.startswith("sluice_requests_total{") or line.startswith("sluice_requests_total "):
            total += float(line.rsplit(" ", 1)[1])
    return round(total)


async def serve(options: BenchOptions, env: dict[str, str], workers: int, rate: float, seconds: float) -> Served:
    config = bench_file(CORE_CONFIG)
    port = free_port()
    args = ["serve", "-c", str(config), "--port", str(port), "--log-level", "warning", "--workers", str(workers)]
    child = spawn(f"gateway {workers} worker(s)", python_module("gateway.cli", *args), None, env)
    pool = Pool(f"http://127.0.0.1:{port}", CLIENT_LIMITS)
    try:
        await wait_ready(child, pool, b"/readyz", time.monotonic() + START_TIMEOUT_S)
        work = workload("fast", False, options.plain_tokens)
        count = max(options.min_requests, round(rate * seconds))
        pids = tree(child.popen.pid)
        before, started = cpu_seconds(pids), time.perf_counter()
        samples = await open_loop(pool, work, rate, count, work, options.concurrency)
        spent, wall = cpu_seconds(pids) - before, time.perf_counter() - started
        status, body = await get(pool, b"/metrics")
        sent = count + options.concurrency  # open_loop primes its connections with `concurrency` requests first
        total = counted(body.decode()) if status == 200 else 0
        return Served(workers, len(pids), sent, len(samples.latency), spent, wall, total)
    finally:
        await pool.aclose()
        child.stop()


async def measure(options: BenchOptions, env: dict[str, str]) -> Workers:
    """Both upstreams of the core config run (it names both); only `fast` is sent to."""
    rate, seconds = RATES.get(options.preset, RATES["default"])
    ports = {"paced": free_port(), "fast": free_port()}
    env = {**env, "SIM_PACED_PORT": str(ports["paced"]), "SIM_FAST_PORT": str(ports["fast"])}
    sims: list[Child] = []
    try:
        for name in ports:
            sims.append(start_sim(name, ports[name], options.tpot_ms if name == "paced" else 0.0, 20, None, env))
        runs = {n: await serve(options, env, n, rate, seconds) for n in WORKERS}
    finally:
        for sim in sims:
            sim.stop()
    errors = sum(r.sent - options.concurrency - r.answered for r in runs.values())
    return Workers(rate, runs, errors)


def checks(w: Workers) -> list[Check]:
    found = [check(NAME, "CPU per request, 2 workers over 1", w.ratio, TARGET_RATIO, "x")]
    for n, run in w.runs.items():
        found.append(check(NAME, f"requests missing from /metrics, {n} worker(s)", abs(run.sent - run.counted), 0, ""))
    return found


def render(w: Workers) -> list[str]:
    lines = [
        "## Workers: one process and two",
        "",
        f"`overhead.yaml` served with `--workers 1` and `--workers 2`, unpinned (every process may use both CPUs), "
        f"sent {w.rate:,.0f} non-streaming req/s (open loop). CPU is the whole process tree's (supervisor and "
        "workers) from /proc; `counted` is `sluice_requests_total` from one scrape of /metrics afterwards.",
        "",
        "| workers | processes | sent | answered | s | tree CPU s | CPU ms per request | counted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, r in w.runs.items():
        lines.append(
            f"| {n} | {r.processes} | {r.sent:,} | {r.answered:,} | {r.seconds:.1f} | {r.cpu_s:.2f} "
            f"| {ms(r.cpu_ms_per_request, 3)} | {r.counted:,} |"
        )
    lines += ["", f"- CPU per request with two workers: {w.ratio:.2f} x one worker's (target ≤ {TARGET_RATIO:g})."]
    return lines
