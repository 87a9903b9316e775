"""What `sluice probe` prints and writes: aligned plain-text tables for people, one JSON document for scripts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tools.probe.client import Sample
from tools.probe.diagnosis import Finding
from tools.probe.summary import PHASES, STAGES, Comparison, TargetSummary

FORMAT = 1  # bumped when the JSON document changes incompatibly
LABELS = {phase: phase.removesuffix("_ms") for phase in PHASES}
FLOOR_ROWS = (
    ("dns", "dns"),
    ("tcp", "tcp connect"),
    ("tls", "tls handshake"),
    ("send", "send"),
    ("head", "wait for head"),
    ("first_token", "head -> first token"),
    ("ttft", "time to first token"),
)


@dataclass(slots=True)
class Report:
    options: dict[str, Any]
    targets: list[TargetSummary] = field(default_factory=list)
    comparison: Comparison | None = None
    findings: list[Finding] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    failure: str | None = None  # why the run stopped before its end

    @property
    def ok(self) -> bool:
        return self.failure is None and all(s.ok for s in self.samples)

    def as_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "ok": self.ok,
            "failure": self.failure,
            "options": self.options,
            "targets": [t.as_json() for t in self.targets],
            "comparison": None if self.comparison is None else self.comparison.as_json(),
            "findings": [f.as_json() for f in self.findings],
            "samples": [s.as_json() for s in self.samples],
        }


def ms(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) < 10:
        return f"{value:.2f}"
    return f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]], text: int) -> list[str]:
    """Aligned columns: the first `text` columns left-aligned, the figures after them right-aligned."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        pairs = enumerate(zip(row, widths, strict=True))
        cells = [cell.ljust(width) if i < text else cell.rjust(width) for i, (cell, width) in pairs]
        lines.append(("  " + "  ".join(cells)).rstrip())
    return lines


def render(report: Report) -> str:
    o = report.options
    lines = [
        f"sluice probe: model {', '.join(sorted({t.model for t in report.targets})) or '?'}, "
        f"{o['samples']} samples per cell after a warm-up",
        "times are ms since the request started (as curl -w); tpot is the mean gap between tokens",
    ]
    for target in report.targets:
        lines += ["", f"== {target.name}: {target.url} =="]
        lines += [*_cold(target), "", *_cells(target), "", *_floor(target), *_gateway(target)]
    if report.comparison is not None:
        lines += ["", "== via minus direct (p50): what the gateway adds, seen from outside =="]
        lines += _comparison(report.comparison)
    lines += ["", *_errors(report), *_findings(report)]
    return "\n".join(lines) + "\n"


def _cold(target: TargetSummary) -> list[str]:
    cold = target.cold
    if cold is None:
        return ["cold request: none"]
    if not cold.ok:
        return [f"cold request failed: {cold.error}"]
    parts = [f"{LABELS[p]} {ms(getattr(cold, p))}" for p in PHASES if getattr(cold, p) is not None]
    line = "cold request (minimal, streamed, new connection): " + "  ".join(parts)
    extra = target.floor.components.get("cold_start")
    return [line if extra is None else f"{line}  (+{ms(extra)} vs warm)"]


def _cells(target: TargetSummary) -> list[str]:
    phases = [p for p in PHASES if any(p in cell.phases for cell in target.cells)]
    header = ["probe", "mode", "conn", "stat", *(LABELS[p] for p in phases), "tokens", "n"]
    rows: list[list[str]] = []
    for cell in target.cells:
        mode = "stream" if cell.stream else "whole"
        if not cell.count:
            rows.append([cell.probe, mode, cell.connection, "-", *("-" for _ in phases), "-", "0"])
            continue
        for i, name in enumerate(("p50", "p90", "max")):
            values = [ms(getattr(cell.phases[p], name)) if p in cell.phases else "-" for p in phases]
            label = [cell.probe, mode, cell.connection] if i == 0 else ["", "", ""]
            extra = ["-" if cell.tokens is None else f"{cell.tokens:g}", str(cell.count)] if i == 0 else ["", ""]
            rows.append([*label, name, *values, *extra])
    return table(header, rows, text=4)


def _floor(target: TargetSummary) -> list[str]:
    floor = target.floor
    lines = ["where the first token's time goes (minimal prompt, streamed, p50):"]
    rows = [[label, ms(floor.fresh.get(key)), ms(floor.reused.get(key))] for key, label in FLOOR_ROWS]
    lines += table(["stage", "fresh", "reused"], rows, text=1)
    if floor.components:
        parts = ", ".join(f"{name} {ms(value)}" for name, value in floor.components.items())
        lines.append(f"  components (ms): {parts}")
    if floor.dominant is not None:
        value = floor.components[floor.dominant]
        lines.append(f"  dominant: {floor.dominant} ({ms(value)} ms): {STAGES[floor.dominant]}")
    if target.reuse_lost:
        lines.append(f"  keep-alive: {target.reuse_lost} of {target.reuse_planned} reuses found the connection closed")
    return lines


def _gateway(target: TargetSummary) -> list[str]:
    view = target.gateway
    if view is None:
        return []
    entries = ", ".join(f"{name} {ms(value)}" for name, value in view.entries.items())
    lines = [
        f"the server's own account ({view.cell}, p50): server-timing {entries or 'none'}; "
        f"x-sluice-overhead-ms {ms(view.overhead_ms)}",
    ]
    if view.client_wait_ms is not None:
        lines.append(
            f"  the client waited {ms(view.client_wait_ms)} ms from request sent to response head; "
            f"{ms(view.outside_ms)} ms of it is outside the server's overhead and upstream time "
            "(network, HTTP server, client)"
        )
    return lines


def _comparison(comparison: Comparison) -> list[str]:
    header = ["probe", "mode", "conn", "ttft direct", "ttft via", "+ttfb", "+ttft", "+tpot", "+total"]
    rows = []
    for direct, via, delta in comparison.deltas:
        rows.append(
            [direct.probe, "stream" if direct.stream else "whole", direct.connection, ms(direct.p50("ttft_ms")),
             ms(via.p50("ttft_ms")), *(ms(delta.get(k)) for k in ("ttfb_ms", "ttft_ms", "tpot_ms", "total_ms"))]
        )  # fmt: skip
    lines = table(header, rows, text=3)
    overhead = comparison.overhead()
    if overhead is not None:
        lines.append(f"  gateway overhead to the first token (minimal, streamed, reused): {ms(overhead)} ms")
    if comparison.reported_ms is not None:
        lines.append(f"  the gateway's own account of it (x-sluice-overhead-ms p50): {ms(comparison.reported_ms)} ms")
    return lines


def _errors(report: Report) -> list[str]:
    failed = [s for s in report.samples if not s.ok]
    lines = []
    if report.failure is not None:
        lines.append(f"FAILED: {report.failure}")
    if failed:
        lines.append(f"{len(failed)} of {len(report.samples)} requests failed:")
        for (target, error), count in Counter((s.target, s.error) for s in failed).most_common():
            lines.append(f"  [{target}] {count}x {error}")
    return lines + ([""] if lines else [])


def _findings(report: Report) -> list[str]:
    if not report.findings:
        if report.ok:
            return ["no problem found: no cause in the troubleshooting table fits these measurements"]
        return ["no diagnosis: the endpoint failed"]
    lines = ["findings:"]
    for i, found in enumerate(report.findings, 1):
        evidence = ", ".join(f"{k}={ms(v) if isinstance(v, float) else v}" for k, v in found.evidence.items())
        lines += [
            f"  {i}. [{found.target}] {found.cause} (stage: {found.stage})",
            f"     seen:     {found.summary}",
            f"     check:    {found.advice}",
            f"     evidence: {evidence}",
        ]
    return lines
