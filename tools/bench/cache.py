"""The `cache` scenario: how fast a cache hit is end to end, and what the cache adds to a miss.

Two processes of the same config (auth + cache, L2 in Redis) run side by side. L1 hits: repeated prompts
through the first, which has them in memory. Redis hits: prompts the first has just answered (and so
written to Redis) sent once each to the second, which has never seen them. They take turns on one schedule
with the same request sent straight to the upstream and with `GET /healthz` on the first process (a round
trip to the gateways' CPU that runs no pipeline: the floor under any hit). Misses: prompts never sent
before, at temperature 0 (cacheable), through `cache`, `auth` (the same minus the cache) and `core` (no
plugins), taking turns. All on the `fast` upstream at 200 req/s per target, streamed (TTFT) and not (the
whole exchange).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from tools.bench.core import GATEWAY as CORE
from tools.bench.figures import (
    Check,
    Difference,
    Dist,
    Row,
    check,
    dist,
    flat,
    latency_row,
    metric_sum,
    ms,
    paired,
    pooled,
    stage_ms,
    us,
)
from tools.bench.load import Lane, Workload, health, send_all, unique_workload, workload
from tools.bench.rig import LANE_WARM, Cells, GatewaySpec, Phase, Rig, add, rotated
from tools.bench.semantic import Semantic
from tools.bench.semantic import measure as measure_semantic
from tools.bench.semantic import render as render_semantic
from tools.bench.tenants import AUTH

NAME = "cache"
L1 = GatewaySpec(NAME, "scenarios/cache.yaml")
L2 = GatewaySpec("cache-l2", "scenarios/cache.yaml")
RATE = 200.0
KINDS = (("stream", True), ("non-stream", False))
DIRECT = "direct"
FLOOR = "GET /healthz"
STORE_WAIT_S = 0.2  # the gateway writes to Redis after each response: let the last writes land
TARGET_L1_MS = 0.3
TARGET_L2_MS = 1.0
HELICONE_REDIS_HIT_MS = 1.62


@dataclass(frozen=True, slots=True)
class Hit:
    layer: str  # "L1" or "Redis"
    kind: str
    row: Row  # vs the same request direct
    hits: int  # responses marked `x-sluice-cache: hit`
    requests: int
    stage: Dist  # server-timing `cache;dur=`


@dataclass(frozen=True, slots=True)
class Miss:
    kind: str
    core: Dist
    auth: Dist
    cache: Dist
    vs_core: Difference  # cache - core, p50 per round
    vs_auth: Difference  # cache - auth: the cache's own part
    misses: int  # responses of `cache` marked `x-sluice-cache: miss`
    requests: int
    stage: Dist


@dataclass(frozen=True, slots=True)
class Cache:
    hits: list[Hit]
    floor: Dist  # GET /healthz on the L1 gateway: a round trip to its CPU through no pipeline
    misses: list[Miss]
    redis_failures: float
    redis_log: list[str]  # what the two processes logged about Redis
    errors: int
    phase: Phase
    semantic: Semantic | None = None  # the semantic cache's hits and misses (tools/bench/semantic.py)


@dataclass(frozen=True, slots=True)
class Shape:
    """One kind of request of this scenario, on the `fast` upstream, at temperature 0 (cacheable)."""

    kind: str  # "stream" or "non-stream"
    stream: bool
    tokens: int
    headers: bytes

    def repeated(self) -> Workload:
        return workload("fast", self.stream, self.tokens, self.headers, deterministic=True)

    def unique(self, count: int) -> Workload:
        return unique_workload("fast", self.stream, self.tokens, count, self.headers)


async def measure(rig: Rig) -> Cache:
    o = rig.options
    cells: Cells = {}
    shapes = [Shape(kind, stream, o.tokens if stream else o.plain_tokens, rig.auth_headers) for kind, stream in KINDS]
    async with rig.phase(NAME, (AUTH, L1, L2)) as phase:
        for number in range(o.rounds):
            for shape in shapes:
                await hits(rig, cells, number, shape, await stored(rig, shape))
                for repeat in range(o.comparisons):
                    await misses(rig, cells, number * o.comparisons + repeat, shape)
        failures = 0.0
        logged: list[str] = []
        for name in (L1.name, L2.name):
            failures += metric_sum(await rig.metrics(name), "sluice_redis_failures_total")
            logged += rig.logged(name, "redis")
    found = figures(cells, failures, logged, phase)
    return replace(found, semantic=await measure_semantic(rig))


async def stored(rig: Rig, shape: Shape) -> Workload:
    """Prompts the first process has just answered, and so written to Redis, that the second has never seen."""
    work = shape.unique(rig.count(RATE))
    await send_all(rig.through(L1.name).fast, work, LANE_WARM)
    await asyncio.sleep(STORE_WAIT_S)
    return work


async def hits(rig: Rig, cells: Cells, number: int, shape: Shape, stored: Workload) -> None:
    """One cell: direct, the health route, L1 hits and Redis hits taking turns. Warming hits the L1 only."""
    first, second, repeated = rig.through(L1.name).fast, rig.through(L2.name).fast, shape.repeated()
    lanes = {
        DIRECT: Lane(rig.direct().fast, repeated, repeated),
        FLOOR: Lane(first, health(), health()),
        L1.name: Lane(first, repeated, repeated),
        L2.name: Lane(second, stored, repeated),
    }
    order = rotated(list(lanes), number)
    for name, samples in zip(order, await rig.interleaved([lanes[n] for n in order], RATE), strict=True):
        add(cells, f"hit {shape.kind}", RATE, name, samples)


async def misses(rig: Rig, cells: Cells, number: int, shape: Shape) -> None:
    """One cell: prompts never sent before through core, auth and cache, taking turns."""
    order = rotated([CORE.name, AUTH.name, NAME], number)
    lanes = [Lane(rig.through(name).fast, shape.unique(rig.count(RATE)), shape.repeated()) for name in order]
    for name, samples in zip(order, await rig.interleaved(lanes, RATE), strict=True):
        add(cells, f"miss {shape.kind}", RATE, name, samples)


def figures(cells: Cells, redis_failures: float, logged: list[str], phase: Phase) -> Cache:
    found = []
    for layer, name in (("L1", L1.name), ("Redis", L2.name)):
        for kind, _ in KINDS:
            direct, through = cells[(f"hit {kind}", RATE, DIRECT)], cells[(f"hit {kind}", RATE, name)]
            found.append(
                Hit(
                    layer,
                    kind,
                    latency_row(RATE, direct, through),
                    sum(s.cache.get(b"hit", 0) for s in through),
                    sum(len(s.latency) for s in through),
                    flat(stage_ms(pooled([s.timing for s in through]), "cache")),
                )
            )
    floor = dist([s.latency for kind, _ in KINDS for s in cells[(f"hit {kind}", RATE, FLOOR)]])
    every = [s for rounds in cells.values() for s in rounds]
    errors = sum(s.errors for s in every)
    misses = [miss(cells, kind) for kind, _ in KINDS]
    return Cache(found, floor, misses, redis_failures, list(dict.fromkeys(logged)), errors, phase)


def miss(cells: Cells, kind: str) -> Miss:
    core, auth, cache = (cells[(f"miss {kind}", RATE, name)] for name in (CORE.name, AUTH.name, NAME))
    latency = [s.latency for s in cache]
    return Miss(
        kind,
        dist([s.latency for s in core]),
        dist([s.latency for s in auth]),
        dist(latency),
        paired(core, cache),
        paired(auth, cache),
        sum(s.cache.get(b"miss", 0) for s in cache),
        sum(len(s.latency) for s in cache),
        flat(stage_ms(pooled([s.timing for s in cache]), "cache")),
    )


def checks(c: Cache) -> list[Check]:
    found = []
    for hit in c.hits:
        limit = TARGET_L1_MS if hit.layer == "L1" else TARGET_L2_MS
        what = "TTFT" if hit.kind == "stream" else "latency"
        figure = f"{hit.layer} hit, {hit.kind} {what} p50 end to end @{RATE:g} req/s"
        found.append(check(NAME, figure, hit.row.through.p50, limit, "ms"))
    return found


def render(c: Cache) -> list[str]:
    return [
        f"## Cache: hits end to end (@{RATE:g} req/s)",
        "",
        "Streams: time to the first token; non-stream: the whole exchange. Direct: the same request sent "
        "straight to the upstream, taking turns with the hits on one schedule. Published anchor, not measured "
        f"here: Helicone AI Gateway reports {HELICONE_REDIS_HIT_MS} ms per Redis cache hit end to end (its own "
        "machine and harness).",
        "",
        "| hit | kind | hits / requests | p50 | p99 | direct p50 | direct p99 | vs direct, p50 "
        "| `cache;dur=` p50 (µs) | own view p50 |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {h.layer} | {h.kind} | {h.hits} / {h.requests} | {ms(h.row.through.p50)} | {ms(h.row.through.p99)} "
            f"| {ms(h.row.direct.p50)} | {ms(h.row.direct.p99)} | {ms(h.row.added_p50)} "
            f"| {us(h.stage.p50, signed=False)} | {ms(h.row.own.p50, 3)} |"
            for h in c.hits
        ),
        f"| floor: `{FLOOR}`, same process, no pipeline | both | - | {ms(c.floor.p50)} | {ms(c.floor.p99)} "
        "| - | - | - | - | - |",
        "",
        f"## Cache: what it adds to a miss (@{RATE:g} req/s, prompts never sent before, temperature 0)",
        "",
        "Differences are per request: requests of one slot, sent a moment apart, median over every pair (range: "
        "over the cells' medians).",
        "",
        "| kind | core p50 | auth p50 | cache p50 | cache - core per request (µs; range) "
        "| cache - auth per request (µs; range) | misses / requests | `cache;dur=` p50 (µs) |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {m.kind} | {ms(m.core.p50)} | {ms(m.auth.p50)} | {ms(m.cache.p50)} | {us(m.vs_core.median)} "
            f"({us(m.vs_core.low)} to {us(m.vs_core.high)}) | {us(m.vs_auth.median)} ({us(m.vs_auth.low)} to "
            f"{us(m.vs_auth.high)}) | {m.misses} / {m.requests} | {us(m.stage.p50, signed=False)} |"
            for m in c.misses
        ),
        *(["", *render_semantic(c.semantic)] if c.semantic is not None else []),
    ]


def notes(c: Cache) -> list[str]:
    found = [
        f"- Cache: Redis failures counted by the two cache processes: {c.redis_failures:.0f}. A miss through "
        "`cache` includes the auth check; `cache - auth` is the cache's own part (key hash, lookups, and the "
        "store after the response, which runs off the request's clock but on the same CPU).",
    ]
    if c.redis_failures:
        lost = sum(h.requests - h.hits for h in c.hits if h.layer == "Redis")
        found.append(
            "- Cache: after each Redis failure a process skips L2 for a second (the store's circuit); Redis-hit "
            f"requests answered otherwise: {lost}. The gateways logged: "
            f"{'; '.join(f'`{line}`' for line in c.redis_log) or 'nothing'}."
        )
    return found
