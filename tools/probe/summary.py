"""The probe's figures: percentiles per cell, the latency floor split into stages, and direct vs via.

A cell is one kind of request (probe, streamed or not, fresh or reused connection); only the warm samples of a
cell ("sample" role, no error) enter its percentiles. The floor is the minimal streamed request to its first
token, split into the stages the diagnosis reasons about; the largest of them is reported as dominant.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.telemetry.quantiles import percentile
from tools.probe.client import Sample

PHASES = ("dns_ms", "connect_ms", "tls_ms", "sent_ms", "ttfb_ms", "ttft_ms", "tpot_ms", "total_ms")
COMPARED = ("ttfb_ms", "ttft_ms", "tpot_ms", "total_ms")
KINDS = ("fresh", "reused")
# What each component of the floor means, for reports and findings.
STAGES = {
    "connection": "opening a new connection (fresh minus reused, to the response head)",
    "send": "writing the request",
    "head": "waiting at the server for the response head",
    "first_token": "from the response head to the first token",
    "cold_start": "extra time of the very first request",
}


@dataclass(frozen=True, slots=True)
class Stat:
    p50: float
    p90: float
    max: float
    n: int

    def as_json(self) -> dict[str, float | int]:
        return {"p50": round(self.p50, 3), "p90": round(self.p90, 3), "max": round(self.max, 3), "n": self.n}


def _p50(values: Iterable[float | None]) -> float | None:
    found = stat(values)
    return None if found is None else found.p50


def stat(values: Iterable[float | None]) -> Stat | None:
    present = [value for value in values if value is not None]
    if not present:
        return None
    return Stat(percentile(present, 0.5), percentile(present, 0.9), max(present), len(present))


@dataclass(slots=True)
class Cell:
    probe: str
    stream: bool
    connection: str
    count: int  # warm samples that succeeded
    errors: int
    phases: dict[str, Stat]
    tokens: float | None  # p50 of content tokens (streams) or completion tokens
    gaps: list[float]  # every gap between content events, all samples pooled

    def p50(self, phase: str) -> float | None:
        found = self.phases.get(phase)
        return None if found is None else found.p50

    def as_json(self) -> dict[str, Any]:
        return {
            "probe": self.probe,
            "stream": self.stream,
            "connection": self.connection,
            "count": self.count,
            "errors": self.errors,
            "tokens_p50": self.tokens,
            "phases": {name: value.as_json() for name, value in self.phases.items()},
            "gaps": None if (gaps := stat(self.gaps)) is None else gaps.as_json(),
        }


def _cell(samples: list[Sample], probe: str, stream: bool, connection: str) -> Cell:
    chosen = [s for s in samples if (s.probe, s.stream, s.connection, s.role) == (probe, stream, connection, "sample")]
    good = [s for s in chosen if s.ok]
    phases = {name: found for name in PHASES if (found := stat(getattr(s, name) for s in good)) is not None}
    tokens = _p50(float(s.tokens) for s in good)
    gaps = [gap for s in good for gap in s.gaps_ms]
    return Cell(probe, stream, connection, len(good), len(chosen) - len(good), phases, tokens, gaps)


def _durations(sample: Sample) -> dict[str, float | None]:
    """The floor's stages for one request, each as a duration rather than a time since the start."""
    setup_end = sample.tls_ms if sample.tls_ms is not None else sample.connect_ms
    return {
        "dns": sample.dns_ms,
        "tcp": _minus(sample.connect_ms, sample.dns_ms),
        "tls": _minus(sample.tls_ms, sample.connect_ms),
        "send": _minus(sample.sent_ms, setup_end or 0.0),
        "head": _minus(sample.ttfb_ms, sample.sent_ms),
        "first_token": _minus(sample.ttft_ms, sample.ttfb_ms),
        "ttft": sample.ttft_ms,
    }


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else max(a - b, 0.0)


@dataclass(slots=True)
class Floor:
    """The minimal streamed request to its first token: p50 per stage, fresh and reused, and what dominates."""

    fresh: dict[str, float | None]
    reused: dict[str, float | None]
    components: dict[str, float]  # the STAGES that could be measured, in ms
    dominant: str | None

    def as_json(self) -> dict[str, Any]:
        def rounded(values: dict[str, float | None]) -> dict[str, float | None]:
            return {k: None if v is None else round(v, 3) for k, v in values.items()}

        return {
            "fresh": rounded(self.fresh),
            "reused": rounded(self.reused),
            "components": {k: round(v, 3) for k, v in self.components.items()},
            "dominant": self.dominant,
        }


def _floor(samples: list[Sample], cells: list[Cell], cold: Sample | None) -> Floor:
    def p50s(connection: str) -> dict[str, float | None]:
        chosen = [
            _durations(s)
            for s in samples
            if s.ok and s.role == "sample" and s.probe == "minimal" and s.stream and s.connection == connection
        ]
        keys = ("dns", "tcp", "tls", "send", "head", "first_token", "ttft")
        return {key: _p50(d[key] for d in chosen) for key in keys}

    fresh, reused = p50s("fresh"), p50s("reused")
    warm = reused if reused["head"] is not None else fresh
    components: dict[str, float] = {}
    connection = _connection_cost(cells)
    if connection is not None:
        components["connection"] = connection
    for key in ("send", "head", "first_token"):
        if (value := warm[key]) is not None:
            components[key] = value
    if (extra := cold_extra(cold, cells)) is not None:
        components["cold_start"] = max(extra, 0.0)  # a cold request faster than warm ones costs nothing
    dominant = max(components, key=lambda name: components[name]) if components else None
    return Floor(fresh, reused, components, dominant)


def find(cells: list[Cell], probe: str, stream: bool, connection: str) -> Cell | None:
    for cell in cells:
        if (cell.probe, cell.stream, cell.connection) == (probe, stream, connection) and cell.count:
            return cell
    return None


def _connection_cost(cells: list[Cell]) -> float | None:
    """What a new connection adds before the response head: fresh minus reused ttfb, minimal streamed probe."""
    fresh, reused = find(cells, "minimal", True, "fresh"), find(cells, "minimal", True, "reused")
    if fresh is None:
        return None
    if reused is None:
        # Without reuse only the handshake itself can be counted.
        end = fresh.p50("tls_ms") or fresh.p50("connect_ms")
        return end
    a, b = fresh.p50("ttfb_ms"), reused.p50("ttfb_ms")
    return None if a is None or b is None else max(a - b, 0.0)


def first_mark(sample: Sample) -> float | None:
    """The time a request is judged by: its first token when it has one, else its end."""
    return sample.ttft_ms if sample.ttft_ms is not None else sample.total_ms


def cold_extra(cold: Sample | None, cells: list[Cell]) -> float | None:
    """How much later than a warm request on a new connection the cold request reached its first token."""
    warm = find(cells, "minimal", True, "fresh")
    if cold is None or not cold.ok or warm is None:
        return None
    mark = first_mark(cold)
    base = warm.p50("ttft_ms") if cold.ttft_ms is not None else warm.p50("total_ms")
    return None if mark is None or base is None else mark - base


@dataclass(slots=True)
class GatewayView:
    """What a Sluice server said about its own time (headers), against what the client saw, one cell."""

    cell: str
    entries: dict[str, float]  # server-timing p50 per stage
    overhead_ms: float | None  # x-sluice-overhead-ms p50
    client_wait_ms: float | None  # request sent -> response head, p50, as the client saw it
    outside_ms: float | None  # client wait minus the gateway's overhead and upstream wait

    def as_json(self) -> dict[str, Any]:
        return {
            "cell": self.cell,
            "server_timing_p50": {k: round(v, 3) for k, v in self.entries.items()},
            "overhead_ms_p50": _round(self.overhead_ms),
            "client_wait_ms_p50": _round(self.client_wait_ms),
            "outside_ms": _round(self.outside_ms),
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _gateway_view(samples: list[Sample]) -> GatewayView | None:
    chosen = [
        s
        for s in samples
        if s.ok and s.role == "sample" and s.probe == "minimal" and s.stream and s.connection == "reused"
    ]
    if not any(s.server_timing or s.overhead_ms is not None for s in chosen):
        return None
    names = list(dict.fromkeys(name for s in chosen for name in s.server_timing))  # in the server's order
    entries = {name: p50 for name in names if (p50 := _p50(s.server_timing.get(name) for s in chosen)) is not None}
    overhead = _p50(s.overhead_ms for s in chosen)
    wait = _p50(_minus(s.ttfb_ms, s.sent_ms) for s in chosen)
    outside = None
    if wait is not None and overhead is not None:
        outside = wait - overhead - entries.get("upstream", 0.0)
    return GatewayView("minimal/stream/reused", entries, overhead, wait, outside)


@dataclass(slots=True)
class TargetSummary:
    name: str  # "direct" or "via"
    url: str
    model: str
    cells: list[Cell]
    cold: Sample | None
    floor: Floor
    gateway: GatewayView | None
    reuse_planned: int  # requests meant for a kept-alive connection
    reuse_lost: int  # of those, how many found it closed and had to open a new one
    errors: int = 0
    # Per probe, the time to first token of the first streamed request of its prompt (the cold request for
    # minimal, the warm-up for the others): the only one a server's prompt cache has not seen before.
    first_ttft: dict[str, float] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "model": self.model,
            "errors": self.errors,
            "cold": None if self.cold is None else self.cold.as_json(),
            "cells": [cell.as_json() for cell in self.cells],
            "floor": self.floor.as_json(),
            "gateway": None if self.gateway is None else self.gateway.as_json(),
            "keepalive": {"planned": self.reuse_planned, "lost": self.reuse_lost},
            "first_ttft_ms": {probe: round(ms, 3) for probe, ms in self.first_ttft.items()},
        }


def summarise(
    name: str, url: str, model: str, samples: list[Sample], probes: Sequence[str], reuse: tuple[int, int]
) -> TargetSummary:
    mine = [s for s in samples if s.target == name]
    cells = [_cell(mine, p, stream, kind) for p in probes for stream in (True, False) for kind in KINDS]
    cold = next((s for s in mine if s.role == "cold"), None)
    summary = TargetSummary(
        name, url, model, cells, cold, _floor(mine, cells, cold), _gateway_view(mine), reuse[0], reuse[1]
    )
    summary.errors = sum(1 for s in mine if not s.ok)
    for s in mine:
        if s.ok and s.stream and s.ttft_ms is not None and s.role in ("cold", "warmup"):
            summary.first_ttft.setdefault(s.probe, s.ttft_ms)
    return summary


@dataclass(slots=True)
class Comparison:
    """Via minus direct, p50 per phase and cell: what the gateway adds as seen from outside."""

    deltas: list[tuple[Cell, Cell, dict[str, float]]] = field(default_factory=list)
    reported_ms: float | None = None  # the gateway's own overhead (x-sluice-overhead-ms p50), when it sends one

    def headline(self) -> tuple[Cell, Cell, dict[str, float]] | None:
        """The minimal streamed probe on reused connections: the floor, without connection setup."""
        for row in self.deltas:
            if (row[0].probe, row[0].stream, row[0].connection) == ("minimal", True, "reused"):
                return row
        return None

    def overhead(self) -> float | None:
        """Extra time to the first token through the gateway, for the headline cell."""
        row = self.headline()
        return None if row is None else row[2].get("ttft_ms")

    def as_json(self) -> dict[str, Any]:
        rows = [
            {
                "probe": direct.probe,
                "stream": direct.stream,
                "connection": direct.connection,
                "direct_p50": {k: _round(direct.p50(k)) for k in COMPARED},
                "via_p50": {k: _round(via.p50(k)) for k in COMPARED},
                "delta_ms": {k: round(v, 3) for k, v in delta.items()},
            }
            for direct, via, delta in self.deltas
        ]
        overhead, reported = _round(self.overhead()), _round(self.reported_ms)
        return {"ttft_overhead_ms": overhead, "reported_overhead_ms": reported, "cells": rows}


def compare(direct: TargetSummary, via: TargetSummary) -> Comparison:
    out = Comparison(reported_ms=None if via.gateway is None else via.gateway.overhead_ms)
    for cell in direct.cells:
        other = find(via.cells, cell.probe, cell.stream, cell.connection)
        if not cell.count or other is None:
            continue
        delta = {}
        for phase in COMPARED:
            a, b = cell.p50(phase), other.p50(phase)
            if a is not None and b is not None:
                delta[phase] = b - a
        out.deltas.append((cell, other, delta))
    return out
