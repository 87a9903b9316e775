"""The figures of `sluice bench`, made from the samples after the load has stopped.

Added p50 = median over rounds of (through p50 - direct p50) within the round: the two sides ran back to
back, so slow drifts of the machine cancel. p99s pool every round's samples. The same rule compares two
gateways: the difference of their p50s within a round, median over rounds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

from gateway.telemetry.quantiles import percentile
from tools.bench.load import Run, Samples

SATURATED_PERCENT = 90.0
T = TypeVar("T")


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
    harness_cpu_percent: float  # load generator + simulated upstreams (+ Redis, sinks), during the through runs

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
class Difference:
    """How much more gateway B adds than gateway A: the median, and its range over the cells compared."""

    median: float
    low: float
    high: float
    pairs: int  # cells (a difference of p50s) or requests (paired request by request)
    cells: int


@dataclass(frozen=True, slots=True)
class Check:
    scenario: str
    figure: str
    goal: str
    value: float
    unit: str
    met: bool


def pooled(rounds: list[list[T]]) -> list[T]:
    return [value for values in rounds for value in values]


def median(values: list[float]) -> float:
    found = [v for v in values if not math.isnan(v)]
    return statistics.median(found) if found else math.nan


def dist(rounds: list[list[float]]) -> Dist:
    values = pooled(rounds)
    return Dist(median([percentile(r, 0.5) for r in rounds if r]), percentile(values, 0.99), len(values))


def flat(values: list[float]) -> Dist:
    return Dist(percentile(values, 0.5), percentile(values, 0.99), len(values))


def latency_row(rate: float, direct: list[Samples], through: list[Samples]) -> Row:
    d, t = dist([s.latency for s in direct]), dist([s.latency for s in through])
    added = [percentile(b.latency, 0.5) - percentile(a.latency, 0.5) for a, b in zip(direct, through, strict=True)]
    own = flat(pooled([s.own for s in through]))
    return Row(rate, d, t, median(added), t.p99 - d.p99, own)


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
        median([r.requests / r.seconds for r in direct]),
        median([r.requests / r.seconds for r in through]),
        100.0 * cpu / seconds,
        1000.0 * cpu / requests if requests else math.nan,
        100.0 * sum(r.core_busy_s for r in through) / seconds,
        100.0 * sum(r.harness_cpu_s for r in through) / seconds,
    )


def difference(a: list[list[float]], b: list[list[float]]) -> Difference:
    """B's p50 minus A's, round by round (each pair measured back to back)."""
    pairs = [percentile(y, 0.5) - percentile(x, 0.5) for x, y in zip(a, b, strict=True) if x and y]
    if not pairs:
        return Difference(math.nan, math.nan, math.nan, 0, 0)
    return Difference(median(pairs), min(pairs), max(pairs), len(pairs), len(pairs))


def paired(a: list[Samples], b: list[Samples], own: bool = False) -> Difference:
    """B minus A request by request: the two requests of a slot of an interleaved cell, sent a moment apart.

    The median over every pair is the added difference per request; its range is that of the cells' medians.
    `own` compares the gateways' own view (x-sluice-overhead-ms) instead of the latency seen by the client.
    """
    every: list[float] = []
    cells: list[float] = []
    for x, y in zip(a, b, strict=True):
        xs, ys = (x.own, y.own) if own else (x.latency, y.latency)
        if len(xs) != len(x.index) or len(ys) != len(y.index):
            continue  # some answer lacked the header: the values no longer line up with the requests
        before = dict(zip(x.index, xs, strict=True))
        found = [late - before[i] for i, late in zip(y.index, ys, strict=True) if i in before]
        if found:
            every += found
            cells.append(median(found))
    if not cells:
        return Difference(math.nan, math.nan, math.nan, 0, 0)
    return Difference(median(every), min(cells), max(cells), len(every), len(cells))


def stage_ms(timings: list[bytes], stage: str) -> list[float]:
    """The durations of one stage in `server-timing` values such as `auth;dur=0.004, upstream;dur=0.3`."""
    wanted = stage.encode()
    found = []
    for value in timings:
        for entry in value.split(b","):
            name, _, duration = entry.strip().partition(b";dur=")
            if name == wanted:
                found.append(float(duration))
                break
    return found


def named(timings: list[bytes], stage: str) -> int:
    """How many `server-timing` values have an entry for `stage`."""
    return len(stage_ms(timings, stage))


def metric_sum(exposition: str, metric: str, labels: str = "") -> float:
    """The sum of a metric's samples in a Prometheus exposition, over the series whose labels contain `labels`."""
    total = 0.0
    for line in exposition.splitlines():
        if line.startswith(metric) and line[len(metric) : len(metric) + 1] in ("{", " ") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def check(scenario: str, figure: str, value: float, limit: float, unit: str, at_least: bool = False) -> Check:
    goal = f"{'≥' if at_least else '≤'} {limit:,g} {unit}"
    met = value >= limit if at_least else value <= limit
    return Check(scenario, figure, goal, value, unit, met)


def ms(value: float, digits: int = 2) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def us(value_ms: float, signed: bool = True) -> str:
    """Milliseconds shown in microseconds; signed by default, for differences of a few microseconds."""
    if math.isnan(value_ms):
        return "n/a"
    return f"{value_ms * 1000.0:+.0f}" if signed else f"{value_ms * 1000.0:.0f}"


def targets(checks: Iterable[Check]) -> list[str]:
    """The table of targets every benchmark page opens with."""
    return [
        "## Targets",
        "",
        "| scenario | figure | target | measured | met |",
        "|---|---|---|---|---|",
        *(
            f"| {c.scenario} | {c.figure} | {c.goal} | {c.value:,.2f} {c.unit} | {'yes' if c.met else '**no**'} |"
            for c in checks
        ),
        "",
    ]
