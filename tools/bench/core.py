"""The `core` scenario: the bare gateway (no plugins) against its upstreams, direct vs through.

Per round: streaming TTFT and non-streaming latency at each rate (open loop), then max throughput of
non-streaming and streaming requests (closed loop); direct and through interleaved cell by cell, their order
swapped every round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tools.bench.figures import (
    SATURATED_PERCENT,
    Check,
    GapRow,
    MaxRow,
    Row,
    check,
    gap_row,
    latency_row,
    max_row,
    ms,
)
from tools.bench.load import Run, Samples, workload
from tools.bench.rig import CORE_CONFIG, FLOOR, BenchOptions, Cells, GatewaySpec, Phase, Rig, add, rotated

NAME = "core"
GATEWAY = GatewaySpec(NAME, CORE_CONFIG)
TARGET_TTFT_MS = 0.6
TARGET_RPS = 4000.0
TARGET_CPU_MS = 0.25
TARGET_GAP_MS = 0.1
TARGET_FLOOR_RATIO = 0.7  # the bare gateway's CPU per non-stream request over the minimal Python proxy's


@dataclass(frozen=True, slots=True)
class Core:
    ttft: list[Row]
    gaps: list[GapRow]
    plain: list[Row]
    maxima: list[MaxRow]
    floor: list[MaxRow]  # the minimal Python proxy (floor.py) in the same closed loops: its CPU per request
    through_requests: int
    through_with_overhead: int
    direct_with_overhead: int
    errors: int
    phase: Phase


async def measure(rig: Rig) -> Core:
    o = rig.options
    cells: Cells = {}
    runs: dict[tuple[str, str], list[Run]] = {}
    async with rig.phase(NAME) as phase:
        await rig.start_floor()
        direct, through, floor = rig.direct(), rig.through(NAME), rig.through(FLOOR)
        paced = workload("paced", True, o.tokens)
        plain = workload("fast", False, o.plain_tokens)
        flood = workload("fast", True, o.tokens)
        for number in range(o.rounds):
            sides = rotated((direct, through), number)
            for kind, work in (("ttft", paced), ("plain", plain)):
                for rate in o.rates:
                    for side in sides:
                        target = side.paced if work is paced else side.fast
                        add(cells, kind, rate, side.name, await rig.open_loop(target, work, rate))
            for mode, work in (("non-stream", plain), ("stream", flood)):
                for side in rotated((direct, through, floor), number):
                    meters = rig.meters(FLOOR if side is floor else NAME)
                    run = await rig.closed_loop(side.fast, work, meters)
                    runs.setdefault((mode, side.name), []).append(run)
        await rig.stop_gateways([FLOOR])
    return figures(o, cells, runs, phase)


def figures(o: BenchOptions, cells: Cells, runs: dict[tuple[str, str], list[Run]], phase: Phase) -> Core:
    def pair(kind: str, rate: float) -> tuple[list[Samples], list[Samples]]:
        return cells[(kind, rate, "direct")], cells[(kind, rate, NAME)]

    def side(name: str) -> list[Samples]:
        found = [s for (_, _, n), rounds in cells.items() if n == name for s in rounds]
        return found + [r.samples for (_, n), done in runs.items() if n == name for r in done]

    through, direct, floor = side(NAME), side("direct"), side(FLOOR)
    return Core(
        ttft=[latency_row(rate, *pair("ttft", rate)) for rate in o.rates],
        gaps=[gap_row(rate, *pair("ttft", rate)) for rate in o.rates],
        plain=[latency_row(rate, *pair("plain", rate)) for rate in o.rates],
        maxima=[max_row(m, runs[(m, "direct")], runs[(m, NAME)]) for m in ("non-stream", "stream")],
        floor=[max_row(m, runs[(m, "direct")], runs[(m, FLOOR)]) for m in ("non-stream", "stream")],
        through_requests=sum(len(s.latency) for s in through),
        through_with_overhead=sum(len(s.own) for s in through),
        direct_with_overhead=sum(len(s.own) for s in direct),
        errors=sum(s.errors for s in through + direct + floor),
        phase=phase,
    )


def checks(core: Core) -> list[Check]:
    found = [
        check(NAME, f"stream TTFT added, p50 @{row.rate:g} req/s", row.added_p50, TARGET_TTFT_MS, "ms")
        for row in core.ttft
        if row.rate in (50.0, 200.0)
    ]
    plain = core.maxima[0]
    worst = max(core.gaps, key=lambda g: g.added_mean)
    return [
        *found,
        check(NAME, "max non-stream req/s, one worker", plain.through_rps, TARGET_RPS, "req/s", at_least=True),
        check(NAME, "gateway CPU per non-stream request at max", plain.cpu_ms_per_request, TARGET_CPU_MS, "ms"),
        check(
            NAME,
            "gateway CPU per non-stream request over the minimal Python proxy's",
            floor_ratio(core, 0),
            TARGET_FLOOR_RATIO,
            "x",
        ),
        check(
            NAME,
            f"gap between chunks added, mean (worst: @{worst.rate:g} req/s)",
            worst.added_mean,
            TARGET_GAP_MS,
            "ms",
        ),
    ]


def render(core: Core, o: BenchOptions, peak_rss_mb: float) -> list[str]:
    rates = " / ".join(f"{r:g}" for r in o.rates)
    return [
        "## Core: summary (the peers' columns)",
        "",
        f"| system | stream TTFT added, p50 ms @{rates} rps | non-stream added, p50 ms @{rates} rps | "
        "max req/s non-stream / stream (one core) | CPU ms per request at max, non-stream / stream | peak RSS MB |",
        "|---|---|---|---|---|---|",
        summary_direct(core),
        summary_gateway(core, peak_rss_mb),
        summary_floor(core),
        "",
        "The minimal Python proxy (tools/bench/floor.py: uvloop and httptools, each request's bytes written to a "
        "pooled keep-alive upstream connection once parsed, the answer's bytes forwarded as read) ran in the same "
        "closed loops, on the same CPU: the gateway's CPU per request over its own, non-stream / stream: "
        f"{floor_ratio(core, 0):.2f}x / {floor_ratio(core, 1):.2f}x.",
        "",
        "## Core: streaming TTFT",
        "",
        *latency_table(core.ttft),
        "",
        "## Core: gaps between streamed token chunks",
        "",
        "| rate | direct mean | through mean | added mean | direct p99 | through p99 | added p99 | gaps (through) |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {g.rate:g} | {ms(g.direct_mean, 3)} | {ms(g.through_mean, 3)} | {ms(g.added_mean, 3)} | "
            f"{ms(g.direct_p99)} | {ms(g.through_p99)} | {ms(g.added_p99)} | {g.count} |"
            for g in core.gaps
        ),
        "",
        "## Core: non-streaming latency",
        "",
        *latency_table(core.plain),
        "",
        f"## Core: max throughput (closed loop, {o.concurrency} connections)",
        "",
        *max_table(core.maxima),
    ]


def max_table(rows: list[MaxRow]) -> list[str]:
    return [
        "| mode | direct req/s | through req/s | gateway CPU % | gateway CPU ms per request "
        "| gateway's CPU busy, all processes % | load generator + upstreams CPU % | limited by |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {m.mode} | {m.direct_rps:,.0f} | {m.through_rps:,.0f} | {m.gateway_cpu_percent:.0f} | "
            f"{ms(m.cpu_ms_per_request, 3)} | {m.core_busy_percent:.0f} | {m.harness_cpu_percent:.0f} | "
            f"{m.limited_by} |"
            for m in rows
        ),
    ]


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


def summary_direct(core: Core) -> str:
    ttft = " / ".join(ms(r.direct.p50) for r in core.ttft)
    plain = " / ".join(ms(r.direct.p50) for r in core.plain)
    rps = " / ".join(f"{m.direct_rps:,.0f}" for m in core.maxima)
    return f"| direct (the limit) | 0 (absolute {ttft}) | 0 (absolute {plain}) | {rps} | - | - |"


def summary_gateway(core: Core, peak_rss_mb: float) -> str:
    ttft = " / ".join(ms(r.added_p50) for r in core.ttft)
    plain = " / ".join(ms(r.added_p50) for r in core.plain)
    rps = " / ".join(f"{m.through_rps:,.0f}" for m in core.maxima)
    cpu = " / ".join(ms(m.cpu_ms_per_request, 3) for m in core.maxima)
    return f"| sluice, one worker | {ttft} | {plain} | {rps} | {cpu} | {peak_rss_mb:.0f} |"


def summary_floor(core: Core) -> str:
    rps = " / ".join(f"{m.through_rps:,.0f}" for m in core.floor)
    cpu = " / ".join(ms(m.cpu_ms_per_request, 3) for m in core.floor)
    return f"| minimal Python proxy (floor.py), one worker | - | - | {rps} | {cpu} | - |"


def floor_ratio(core: Core, mode: int) -> float:
    """The gateway's CPU per request over the minimal proxy's, in mode 0 (non-stream) or 1 (stream)."""
    floor = core.floor[mode].cpu_ms_per_request
    return core.maxima[mode].cpu_ms_per_request / floor if floor > 0 else math.nan


def notes(core: Core) -> list[str]:
    top = core.ttft[-1]
    keeps_up = (
        "sub-millisecond: the load generator keeps up"
        if top.direct.p50 < 1.0
        else "NOT sub-millisecond: the load generator or the upstream is slow, so the added figures are unreliable"
    )
    found = [
        f"- Core: through-gateway responses carrying `x-sluice-overhead-ms`: {core.through_with_overhead} of "
        f"{core.through_requests}; direct responses carrying it: {core.direct_with_overhead}.",
        f"- Core: load generator check: direct TTFT p50 at {top.rate:g} req/s is {ms(top.direct.p50)} ms ({keeps_up}).",
    ]
    for row in core.maxima:
        if row.gateway_cpu_percent < SATURATED_PERCENT:
            found.append(
                f"- Core: {row.mode} max: the gateway used {row.gateway_cpu_percent:.0f} % of a CPU, so it was "
                f"not saturated ({row.limited_by}); {row.through_rps:,.0f} req/s is a lower bound."
            )
    return found
