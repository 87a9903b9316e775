"""The `tracing` scenario: what OTLP span export costs, at sample ratios 1.0 and 0.1, against tracing off.

Two more processes of the core config, each exporting to its own OTLP sink (`bench_sink`, on the load
generator's CPU); the core gateway is tracing off. Per round: streaming TTFT at 200 req/s on all three and
the direct upstream, then max non-streaming throughput of the three (closed loop), with the gateway's CPU
time per request. The sinks count the spans they received once the gateways have flushed them at exit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tools.bench.core import GATEWAY as CORE
from tools.bench.core import NAME as CORE_NAME
from tools.bench.figures import (
    SATURATED_PERCENT,
    Difference,
    MaxRow,
    Row,
    difference,
    latency_row,
    max_row,
    metric_sum,
    ms,
    us,
)
from tools.bench.load import Run, workload
from tools.bench.rig import Cells, GatewaySpec, Phase, Rig, add, rotated

NAME = "tracing"
RATIOS = ("1.0", "0.1")
SINKS = tuple(f"otlp sink {ratio}" for ratio in RATIOS)
RATE = 200.0


def spec(ratio: str, sink: str) -> GatewaySpec:
    env = (("BENCH_SAMPLE_RATIO", ratio), ("BENCH_OTLP_ENDPOINT", sink))
    return GatewaySpec(gateway_name(ratio), "scenarios/tracing.yaml", env)


def gateway_name(ratio: str) -> str:
    return f"tracing {ratio}"


@dataclass(frozen=True, slots=True)
class Variant:
    name: str  # "core" (tracing off) or "tracing R"
    ratio: str  # "off", "1.0", "0.1"
    ttft: Row  # vs direct
    vs_off: Difference  # TTFT p50, this - off, cell by cell
    own_vs_off: Difference  # the same in the gateway's own view (x-sluice-overhead-ms)
    maximum: MaxRow
    served: float  # requests the gateway counted (measured, warm-up and priming)
    spans: int  # received by its sink
    dropped: float  # spans the gateway dropped because its export queue was full


@dataclass(frozen=True, slots=True)
class Tracing:
    variants: list[Variant]
    errors: int
    phase: Phase

    def off(self) -> Variant:
        return self.variants[0]


async def measure(rig: Rig) -> Tracing:
    o = rig.options
    cells: Cells = {}
    runs: dict[str, list[Run]] = {}
    specs = [spec(ratio, rig.url(sink)) for ratio, sink in zip(RATIOS, SINKS, strict=True)]
    counted: dict[str, tuple[float, float]] = {}
    names = [CORE.name, *(s.name for s in specs)]
    async with rig.phase(NAME, specs) as phase:
        direct = rig.direct()
        paced = workload("paced", True, o.tokens)
        plain = workload("fast", False, o.plain_tokens)
        for number in range(o.rounds):
            for repeat in range(o.comparisons):
                sides = rotated([direct, *(rig.through(name) for name in names)], number * o.comparisons + repeat)
                for side in sides:
                    add(cells, "ttft", RATE, side.name, await rig.open_loop(side.paced, paced, RATE))
            for name in rotated(names, number):
                run = await rig.closed_loop(rig.through(name).fast, plain, rig.meters(name))
                runs.setdefault(name, []).append(run)
        for name in names:
            exposition = await rig.metrics(name)
            served = metric_sum(exposition, "sluice_requests_total")
            counted[name] = (served, metric_sum(exposition, "sluice_trace_spans_total", 'result="dropped"'))
    # The gateways have stopped, so each has flushed its queue to its sink.
    spans = {s.name: await rig.sink_spans(sink) for s, sink in zip(specs, SINKS, strict=True)}
    return figures(cells, runs, counted, spans, phase)


def figures(
    cells: Cells,
    runs: dict[str, list[Run]],
    counted: dict[str, tuple[float, float]],
    spans: dict[str, int],
    phase: Phase,
) -> Tracing:
    direct = cells[("ttft", RATE, "direct")]
    off = cells[("ttft", RATE, CORE_NAME)]
    variants = []
    for name in (CORE_NAME, *(gateway_name(ratio) for ratio in RATIOS)):
        found = runs[name]
        ttft = cells[("ttft", RATE, name)]
        ratio = "off" if name == CORE_NAME else name.removeprefix(gateway_name(""))
        served, dropped = counted[name]
        variants.append(
            Variant(
                name,
                ratio,
                latency_row(RATE, direct, ttft),
                difference([s.latency for s in off], [s.latency for s in ttft]),
                difference([s.own for s in off], [s.own for s in ttft]),
                max_row("non-stream", [], found),
                served,
                spans.get(name, 0),
                dropped,
            )
        )
    every = [s for rounds in cells.values() for s in rounds] + [r.samples for done in runs.values() for r in done]
    return Tracing(variants, sum(s.errors for s in every), phase)


def render(t: Tracing) -> list[str]:
    off = t.off()
    return [
        "## Tracing: OTLP export on vs off",
        "",
        f"Stream TTFT at {RATE:g} req/s against the direct upstream; max throughput from a closed loop of "
        "non-streaming requests. Spans go over OTLP/HTTP to a sink on the load generator's CPU that decodes and "
        "counts them.",
        "",
        "Each tracing gateway ran in its own cells (not taking turns with the others), so that the export thread's "
        "work lands on its own measurements; vs off = the difference of p50s cell by cell, median (range).",
        "",
        "| tracing | TTFT added p50 / p99 | TTFT vs off, p50 (µs; range) | own view vs off, p50 (µs) "
        "| max non-stream req/s | gateway CPU % | CPU ms per request | CPU vs off per request (µs) "
        "| spans received / requests served | spans dropped |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(variant_line(v, off) for v in t.variants),
    ]


def variant_line(v: Variant, off: Variant) -> str:
    vs_off = "-" if v is off else f"{us(v.vs_off.median)} ({us(v.vs_off.low)} to {us(v.vs_off.high)})"
    own_vs_off = "-" if v is off else us(v.own_vs_off.median)
    cpu_vs_off = "-" if v is off else us(v.maximum.cpu_ms_per_request - off.maximum.cpu_ms_per_request)
    per_request = v.spans / v.served if v.served else math.nan
    spans = "-" if v is off else f"{v.spans:,} / {v.served:,.0f} ({ms(per_request)} per request)"
    return (
        f"| {v.ratio} | {ms(v.ttft.added_p50)} / {ms(v.ttft.added_p99)} | {vs_off} | {own_vs_off} "
        f"| {v.maximum.through_rps:,.0f} "
        f"| {v.maximum.gateway_cpu_percent:.0f} | {ms(v.maximum.cpu_ms_per_request, 3)} | {cpu_vs_off} | {spans} "
        f"| {'-' if v is off else f'{v.dropped:,.0f}'} |"
    )


def notes(t: Tracing) -> list[str]:
    found = []
    for v in t.variants:
        if v.maximum.gateway_cpu_percent < SATURATED_PERCENT:
            found.append(
                f"- Tracing {v.ratio}: the gateway used {v.maximum.gateway_cpu_percent:.0f} % of a CPU at max "
                f"({v.maximum.limited_by}): {v.maximum.through_rps:,.0f} req/s is a lower bound."
            )
    return found
