"""The `tenants` scenario: auth and the Redis-backed rate limiter, and what each adds per request.

Three gateways get the same requests, all carrying the tenant's key: `core` (no plugins), `auth` (the auth
plugin alone, its key in the config, no Redis) and `tenants` (auth + rate_limit, buckets in Redis). Against
the direct upstream: `tenants` at 50 and 200 req/s. At 200 req/s all three and the direct upstream take
turns request by request on one schedule, so that `auth - core` is the cost of a cached auth check and
`tenants - auth` the cost of the limiter's Redis round trip; `server-timing` gives each stage's own duration
beside those end-to-end differences.
"""

from __future__ import annotations

from dataclasses import dataclass

from tools.bench.core import GATEWAY as CORE
from tools.bench.figures import (
    Check,
    Difference,
    Dist,
    MaxRow,
    Row,
    check,
    flat,
    latency_row,
    max_row,
    metric_sum,
    ms,
    named,
    paired,
    pooled,
    stage_ms,
    us,
)
from tools.bench.load import Lane, Run, Samples, Workload, workload
from tools.bench.rig import Cells, GatewaySpec, Phase, Rig, Side, add, rotated, samples_of

NAME = "tenants"
AUTH = GatewaySpec("auth", "scenarios/auth.yaml")
TENANTS = GatewaySpec(NAME, "scenarios/tenants.yaml")
RATES = (50.0, 200.0)
COMPARED_AT = 200.0
KINDS = ("ttft", "plain")
GATEWAYS = (CORE.name, AUTH.name, NAME)
TARGET_AUTH_US = 20.0
# In a closed loop each client connection can have two Redis commands in flight in `tenants`: its request's
# check, and the correction of its previous request, which runs after that one's answer. The gateway's Redis
# pool has 64 connections and fails at once when all are taken, which opens its circuit for a second and moves
# the limiter to in-process buckets; 16 connections stay within it, so the closed loops measure Redis.
HOT_CONNECTIONS = 16


@dataclass(frozen=True, slots=True)
class Tenants:
    rows: dict[tuple[str, str, float], Row]  # (gateway, kind, rate) -> vs direct
    auth_cost: Difference  # auth - core, end to end, request by request (ms)
    auth_own: Difference  # the same in the gateway's own view (x-sluice-overhead-ms)
    auth_stage: Dist  # server-timing `auth;dur=` of the auth gateway
    limiter_cost: Difference  # tenants - auth, end to end
    limiter_own: Difference
    limiter_stage: Dist  # server-timing `rate_limit;dur=` of the tenants gateway
    requests: dict[str, int]  # through responses per gateway, measured cells only
    named: dict[tuple[str, str], int]  # (gateway, stage) -> responses whose server-timing has that stage
    maxima: dict[str, MaxRow]  # closed loop, non-stream: each gateway with its CPU caches hot
    hot_stages: dict[str, Dist]  # `auth;dur=` of auth, `rate_limit;dur=` of tenants, in those closed loops
    redis_failures: float
    redis_log: list[str]  # what the gateway logged about Redis (its circuit opening and closing)
    errors: int
    phase: Phase


async def measure(rig: Rig) -> Tenants:
    o = rig.options
    cells: Cells = {}
    runs: dict[str, list[Run]] = {}
    async with rig.phase(NAME, (AUTH, TENANTS)) as phase:
        direct = rig.direct()
        gateways = [rig.through(name) for name in GATEWAYS]
        works = {
            "ttft": workload("paced", True, o.tokens, rig.auth_headers),
            "plain": workload("fast", False, o.plain_tokens, rig.auth_headers),
        }
        for number in range(o.rounds):
            for kind, work in works.items():
                await cell(rig, cells, kind, work, 50.0, rotated([direct, gateways[-1]], number))
                for repeat in range(o.comparisons):
                    sides = rotated([direct, *gateways], number * o.comparisons + repeat)
                    await cell(rig, cells, kind, work, COMPARED_AT, sides)
            for name in rotated(GATEWAYS, number):
                run = await rig.closed_loop(rig.through(name).fast, works["plain"], rig.meters(name), HOT_CONNECTIONS)
                runs.setdefault(name, []).append(run)
        failures = metric_sum(await rig.metrics(NAME), "sluice_redis_failures_total")
        logged = rig.logged(NAME, "redis")
    return figures(cells, runs, failures, logged, phase)


async def cell(rig: Rig, cells: Cells, kind: str, work: Workload, rate: float, sides: list[Side]) -> None:
    """The sides taking turns on one schedule, each at `rate`."""
    lanes = [Lane(side.paced if kind == "ttft" else side.fast, work, work) for side in sides]
    for side, samples in zip(sides, await rig.interleaved(lanes, rate), strict=True):
        add(cells, kind, rate, side.name, samples)


def figures(
    cells: Cells, runs: dict[str, list[Run]], redis_failures: float, logged: list[str], phase: Phase
) -> Tenants:
    def at(name: str) -> list[Samples]:
        """A gateway's samples at the compared rate, both kinds, in one order for every gateway."""
        return [s for kind in KINDS for s in cells[(kind, COMPARED_AT, name)]]

    rows = {
        (name, kind, rate): latency_row(rate, cells[(kind, rate, "direct")], cells[(kind, rate, name)])
        for (kind, rate, name) in cells
        if name != "direct"
    }
    core, auth, tenants = at(CORE.name), at(AUTH.name), at(NAME)
    every = [s for rounds in cells.values() for s in rounds]
    return Tenants(
        rows=rows,
        auth_cost=paired(core, auth),
        auth_own=paired(core, auth, own=True),
        auth_stage=flat(stage_ms(pooled([s.timing for s in auth]), "auth")),
        limiter_cost=paired(auth, tenants),
        limiter_own=paired(auth, tenants, own=True),
        limiter_stage=flat(stage_ms(pooled([s.timing for s in tenants]), "rate_limit")),
        requests={name: sum(len(s.latency) for s in samples_of(cells, name)) for name in GATEWAYS},
        named={
            (name, stage): sum(named(s.timing, stage) for s in samples_of(cells, name))
            for name in (AUTH.name, NAME)
            for stage in ("auth", "rate_limit")
        },
        maxima={name: max_row("non-stream", [], done) for name, done in runs.items()},
        hot_stages={
            stage: flat(stage_ms(pooled([r.samples.timing for r in runs[name]]), stage))
            for name, stage in ((AUTH.name, "auth"), (NAME, "rate_limit"))
        },
        redis_failures=redis_failures,
        redis_log=logged,
        errors=sum(s.errors for s in every) + sum(r.samples.errors for done in runs.values() for r in done),
        phase=phase,
    )


def checks(t: Tenants) -> list[Check]:
    figure = f"cached auth check alone: added per request (median), auth - core @{COMPARED_AT:g} req/s"
    return [check(NAME, figure, t.auth_cost.median * 1000.0, TARGET_AUTH_US, "µs")]


def render(t: Tenants) -> list[str]:
    return [
        "## Tenants: auth + Redis rate limiter",
        "",
        "Every request carries the tenant's key, direct ones too. `tenants` = auth + rate_limit with Redis; "
        "`auth` = the auth plugin alone (key in the config, no Redis); `core` = no plugins.",
        "",
        "| gateway | rate | stream TTFT added p50 / p99 | non-stream added p50 / p99 "
        "| own view (x-sluice-overhead-ms) p50, stream / non-stream |",
        "|---|---|---|---|---|",
        *(row_line(t, name, rate) for name, rate in ((NAME, 50.0), (NAME, 200.0), ("auth", 200.0), ("core", 200.0))),
        "",
        f"### What each plugin adds per request (@{COMPARED_AT:g} req/s, stream and non-stream cells pooled)",
        "",
        "Differences are per request: the two gateways' requests of one slot, sent a moment apart, median over "
        "every pair; the range is that of the cells' medians.",
        "",
        "| figure | median per request | range over cells | request pairs / cells |",
        "|---|---|---|---|",
        diff_line("cached auth check: auth - core, end to end (µs)", t.auth_cost),
        diff_line("the same in the gateway's own view (x-sluice-overhead-ms, µs)", t.auth_own),
        stage_line("auth", t.auth_stage),
        diff_line("Redis rate limiter: tenants - auth, end to end (µs)", t.limiter_cost),
        diff_line("the same in the gateway's own view (µs)", t.limiter_own),
        stage_line("rate_limit", t.limiter_stage),
        "",
        f"### The same with hot CPU caches (closed loop, non-stream, {HOT_CONNECTIONS} connections)",
        "",
        "At 200 req/s the gateways' CPU idles between requests and every request starts with cold caches, so "
        "each stage takes several times longer than when the gateway is busy. CPU time per request at max "
        "throughput is the cost with hot caches.",
        "",
        "| gateway | max req/s | gateway CPU % | CPU ms per request | CPU vs core per request (µs) "
        "| stage p50 / p99 at max (µs) | limited by |",
        "|---|---|---|---|---|---|---|",
        *(hot_line(t, name) for name in GATEWAYS),
    ]


def row_line(t: Tenants, name: str, rate: float) -> str:
    stream, plain = t.rows[(name, "ttft", rate)], t.rows[(name, "plain", rate)]
    return (
        f"| {name} | {rate:g} | {ms(stream.added_p50)} / {ms(stream.added_p99)} | {ms(plain.added_p50)} / "
        f"{ms(plain.added_p99)} | {ms(stream.own.p50, 3)} / {ms(plain.own.p50, 3)} |"
    )


def stage_line(stage: str, d: Dist) -> str:
    p50, p99 = us(d.p50, signed=False), us(d.p99, signed=False)
    return f"| `{stage};dur=` in server-timing, p50 / p99 (µs) | {p50} / {p99} | - | {d.count} responses |"


def hot_line(t: Tenants, name: str) -> str:
    m, core = t.maxima[name], t.maxima[CORE.name]
    vs_core = "-" if name == CORE.name else us(m.cpu_ms_per_request - core.cpu_ms_per_request)
    stage = {AUTH.name: "auth", NAME: "rate_limit"}.get(name)
    hot = t.hot_stages[stage] if stage is not None else None
    stages = "-" if hot is None else f"`{stage}` {us(hot.p50, signed=False)} / {us(hot.p99, signed=False)}"
    return (
        f"| {name} | {m.through_rps:,.0f} | {m.gateway_cpu_percent:.0f} | {ms(m.cpu_ms_per_request, 3)} | {vs_core} "
        f"| {stages} | {m.limited_by} |"
    )


def diff_line(figure: str, d: Difference) -> str:
    return f"| {figure} | {us(d.median)} | {us(d.low)} to {us(d.high)} | {d.pairs:,} / {d.cells} |"


def notes(t: Tenants) -> list[str]:
    found = [
        f"- Tenants: `server-timing` named `auth` in {t.named[('auth', 'auth')]} of {t.requests['auth']} responses "
        f"of `auth`, and `auth` / `rate_limit` in {t.named[(NAME, 'auth')]} / {t.named[(NAME, 'rate_limit')]} "
        f"of {t.requests[NAME]} of `tenants`; Redis failures counted by `tenants`: {t.redis_failures:.0f}.",
    ]
    if t.redis_failures:
        found.append(
            "- Tenants: after each Redis failure the limiter ran on in-process buckets for a second (the store's "
            f"circuit); the gateway logged: {'; '.join(f'`{line}`' for line in t.redis_log) or 'nothing'}."
        )
    return found
