"""The rig a `sluice bench` scenario measures with: the running processes, a client pool to each, and meters.

The helpers (simulated upstreams, Redis, OTLP sinks) start once and share the load generator's CPU; the
gateways run on the other CPU. The core gateway runs for the whole run, as every scenario's baseline; each
scenario starts the gateways it adds when its phase begins and stops them when it ends, so that a phase
never shares the gateways' CPU with idle processes of another.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import orjson

from gateway.upstream.pool import Pool
from plugins.auth.keys import new_key
from tools.bench.fleet import (
    BenchError,
    Child,
    Placement,
    bench_file,
    busy_seconds,
    free_port,
    python_module,
    spawn,
    start_gateway,
    start_redis,
    start_sim,
    start_sink,
    tcp_counters,
    wait_redis,
)
from tools.bench.load import (
    CLIENT_LIMITS,
    JSON_HEADERS,
    Lane,
    Meters,
    Run,
    Samples,
    Workload,
    closed_loop,
    get,
    interleaved,
    open_loop,
    wait_ready,
)

T = TypeVar("T")
START_TIMEOUT_S = 30.0
CORE_CONFIG = "scenarios/overhead.yaml"
FLOOR = "floor"  # the minimal Python proxy (floor.py): the core scenario's yardstick for CPU per request
# Connections an interleaved cell opens before it is timed: a few are plenty at these rates, and a burst of
# 32 cache misses at once exhausts a gateway's Redis connection pool (64, failing at once when full), which
# opens its Redis circuit for a second: the cells after it would measure the fallback, not Redis.
LANE_WARM = 8


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
    comparisons: int = 3  # per round: cells where gateways are compared with each other (tenants, cache)
    fill_prompts: int = 100_000  # full: unique prompts cached before its peak RSS is read
    scenarios: tuple[str, ...] = ("core",)
    config: str | None = None  # the core gateway's config; default bench/scenarios/overhead.yaml
    write: str | None = None
    command: str = ""
    preset: str = "default"


@dataclass(frozen=True, slots=True)
class GatewaySpec:
    name: str
    config: str  # under bench/
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Side:
    name: str  # "direct", or the gateway's name
    paced: Pool
    fast: Pool


@dataclass(slots=True)
class Phase:
    """One scenario's measurement window: how much of the machine other processes used meanwhile."""

    name: str
    seconds: float = math.nan
    others_percent: float = math.nan  # the machine's CPU time used by processes other than ours
    tcp: tuple[int, int] = (0, 0)  # machine-wide: segments retransmitted, retransmission timeouts


@dataclass(slots=True)
class Gateway:
    child: Child
    pool: Pool


@dataclass(slots=True)
class Rig:
    options: BenchOptions
    where: Placement
    env: dict[str, str]
    ports: dict[str, int]
    helpers: dict[str, Child]  # sims, Redis, sinks: on the load generator's CPU
    key: str
    gateways: dict[str, Gateway] = field(default_factory=dict)
    pools: dict[str, Pool] = field(default_factory=dict)

    @classmethod
    def launch(cls, options: BenchOptions, where: Placement, redis: bool, sinks: Sequence[str]) -> Rig:
        """Start the helpers (not yet waited for): the two upstreams, and Redis and sinks if asked for."""
        key, hashed = new_key()
        ports = {"paced": free_port(), "fast": free_port()}
        env = {**os.environ, "SIM_PACED_PORT": str(ports["paced"]), "SIM_FAST_PORT": str(ports["fast"])}
        env["BENCH_KEY_HASH"] = hashed
        rig = cls(options, where, env, ports, {}, key)
        try:
            cpu = where.harness_cpu
            for name, tpot in (("paced", options.tpot_ms), ("fast", 0.0)):
                rig.helpers[name] = start_sim(name, ports[name], tpot, options.tokens, cpu, env)
            if redis:
                ports["redis"] = free_port()
                env["BENCH_REDIS_URL"] = f"redis://127.0.0.1:{ports['redis']}/0"
                rig.helpers["redis"] = start_redis(ports["redis"], cpu, env)
            for name in sinks:
                ports[name] = free_port()
                rig.helpers[name] = start_sink(name, ports[name], cpu, env)
        except BaseException:
            rig.stop()
            raise
        return rig

    @property
    def auth_headers(self) -> bytes:
        return JSON_HEADERS + b"authorization: Bearer " + self.key.encode() + b"\r\n"

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    async def connect(self) -> None:
        """Open a client pool to each helper and wait until each answers."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for name, child in self.helpers.items():
            if name == "redis":
                await wait_redis(child, self.ports[name], deadline)
                continue
            self.pools[name] = Pool(self.url(name), CLIENT_LIMITS)
            await wait_ready(child, self.pools[name], b"/health" if name in ("paced", "fast") else b"/stats", deadline)

    async def start_gateways(self, specs: Sequence[GatewaySpec]) -> None:
        started = []
        for spec in specs:
            port = free_port()
            child = start_gateway(
                spec.name, self.config_path(spec), port, self.where.gateway_cpu, {**self.env, **dict(spec.env)}
            )
            self.ports[spec.name] = port
            self.gateways[spec.name] = Gateway(child, Pool(self.url(spec.name), CLIENT_LIMITS))
            started.append(spec.name)
        deadline = time.monotonic() + START_TIMEOUT_S
        for name in started:
            gateway = self.gateways[name]
            await wait_ready(gateway.child, gateway.pool, b"/readyz", deadline)

    def config_path(self, spec: GatewaySpec) -> Path:
        """The spec's file under bench/; `--config` replaces the core's."""
        if spec.config == CORE_CONFIG and self.options.config:
            found = Path(self.options.config).resolve()
            if not found.exists():
                raise BenchError(f"gateway config not found: {found}")
            return found
        return bench_file(spec.config)

    async def start_floor(self) -> None:
        """The minimal Python proxy (floor.py) in front of the `fast` upstream, on the gateways' CPU, as `floor`."""
        port = free_port()
        child = spawn(
            FLOOR,
            python_module("tools.bench.floor", "--port", str(port), "--upstream", self.url("fast")),
            self.where.gateway_cpu,
            self.env,
        )
        self.ports[FLOOR] = port
        self.gateways[FLOOR] = gateway = Gateway(child, Pool(self.url(FLOOR), CLIENT_LIMITS))
        await wait_ready(child, gateway.pool, b"/health", time.monotonic() + START_TIMEOUT_S)

    async def stop_gateways(self, names: Sequence[str]) -> None:
        for name in names:
            gateway = self.gateways.pop(name, None)
            if gateway is not None:
                await gateway.pool.aclose()  # idle keep-alive connections would hold up its graceful exit
                gateway.child.stop()

    def direct(self) -> Side:
        return Side("direct", self.pools["paced"], self.pools["fast"])

    def through(self, name: str) -> Side:
        pool = self.gateways[name].pool
        return Side(name, pool, pool)

    # Meters

    def harness_cpu_seconds(self) -> float:
        return time.process_time() + sum(child.cpu_seconds() for child in self.helpers.values())

    def ours_cpu_seconds(self) -> float:
        return self.harness_cpu_seconds() + sum(g.child.cpu_seconds() for g in self.gateways.values())

    def core_busy_seconds(self) -> float:
        """Busy time of the gateways' CPU (unpinned: of an average CPU), whoever used it."""
        if self.where.gateway_cpu is None:
            return busy_seconds("cpu") / (os.cpu_count() or 1)
        return busy_seconds(f"cpu{self.where.gateway_cpu}")

    def meters(self, name: str) -> Meters:
        child = self.gateways[name].child
        return lambda: (child.cpu_seconds(), self.core_busy_seconds(), self.harness_cpu_seconds())

    def machine_meters(self) -> tuple[float, float, float, float, float]:
        """(wall time, CPU time busy machine-wide, ours, TCP segments retransmitted, TCP retransmission timeouts)."""
        retransmits, timeouts = tcp_counters()
        return time.perf_counter(), busy_seconds("cpu"), self.ours_cpu_seconds(), retransmits, timeouts

    @contextlib.asynccontextmanager
    async def phase(self, name: str, specs: Sequence[GatewaySpec] = ()) -> AsyncIterator[Phase]:
        """Start a scenario's own gateways, meter the machine while it measures, stop them at the end."""
        await self.start_gateways(specs)
        found = Phase(name)
        try:
            before = self.machine_meters()
            yield found
            wall, busy, ours, retransmits, timeouts = (
                b - a for a, b in zip(before, self.machine_meters(), strict=True)
            )
            found.seconds = wall
            found.others_percent = 100.0 * max(busy - ours, 0.0) / (wall * (os.cpu_count() or 1))
            found.tcp = (round(retransmits), round(timeouts))
        finally:
            await self.stop_gateways([spec.name for spec in specs])

    async def metrics(self, name: str) -> str:
        """A gateway's Prometheus exposition (what it counted: spans dropped, Redis failures)."""
        status, body = await get(self.gateways[name].pool, b"/metrics")
        return body.decode() if status == 200 else ""

    async def sink_spans(self, name: str) -> int:
        status, body = await get(self.pools[name], b"/stats")
        return int(orjson.loads(body)["spans"]) if status == 200 else 0

    # Load

    def count(self, rate: float) -> int:
        o = self.options
        return max(o.min_requests, min(o.max_requests, round(rate * o.cell_seconds)))

    async def open_loop(self, pool: Pool, work: Workload, rate: float, warm: Workload | None = None) -> Samples:
        count = self.count(rate)
        return await open_loop(pool, work, rate, count, warm or work, self.options.concurrency)

    async def interleaved(self, lanes: list[Lane], rate: float) -> list[Samples]:
        """Lanes taking turns on one schedule, each at `rate`, primed with a small burst (see LANE_WARM)."""
        return await interleaved(lanes, rate, self.count(rate), min(self.options.concurrency, LANE_WARM))

    async def closed_loop(self, pool: Pool, work: Workload, meters: Meters, connections: int | None = None) -> Run:
        o = self.options
        concurrency = min(connections or o.concurrency, o.concurrency)
        return await closed_loop(pool, work, concurrency, o.max_warmup_seconds, o.max_seconds, meters)

    def logged(self, name: str, marker: str) -> list[str]:
        """A gateway's log lines (stderr: warnings and errors) that contain `marker`, each once."""
        lines = self.gateways[name].child.output().splitlines()
        return list(dict.fromkeys(line.strip() for line in lines if marker in line))

    async def aclose(self) -> None:
        await self.stop_gateways(list(self.gateways))
        for pool in self.pools.values():
            await pool.aclose()

    def stop(self) -> None:
        for gateway in self.gateways.values():
            gateway.child.stop()
        for child in self.helpers.values():
            child.stop()


def rotated(sides: Sequence[T], number: int) -> list[T]:
    """The sides in the order of round `number`: each takes every position in turn (two sides: swapped)."""
    k = number % len(sides)
    return [*sides[k:], *sides[:k]]


Cells = dict[tuple[str, float, str], list[Samples]]


def add(cells: Cells, kind: str, rate: float, side: str, samples: Samples) -> None:
    cells.setdefault((kind, rate, side), []).append(samples)


def samples_of(cells: Cells, name: str) -> list[Samples]:
    """Every sample of one side, all cells and rounds."""
    return [s for (_, _, n), rounds in cells.items() if n == name for s in rounds]
