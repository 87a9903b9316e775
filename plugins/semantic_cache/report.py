"""The evaluation's report: the curve, the suggestion, the per-kind table, each rule's cost, as text or JSON, and
the pairs the guards got wrong (`--explain`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TextIO

from plugins.semantic_cache.evaluation import NEAR_MARGIN, Evaluation, Point


def _quantile(ordered: Sequence[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def render(ev: Evaluation, out: TextIO, every: int = 1, at: float | None = None) -> None:
    """The curve (every `every`-th threshold), the suggestion and the per-kind table, as Markdown tables."""
    positives = ev.plain[0].positives
    negatives = ev.plain[0].negatives
    out.write(f"{len(ev.scored)} pairs: {positives} should hit, {negatives} must not. ")
    out.write(f"ROC-AUC of the cosine alone: {ev.roc_auc:.3f}. Guards: {ev.guard_seconds * 1e6:.0f} µs a pair.\n")
    if ev.rule_us:
        costs = ", ".join(f"{name} {us:.1f}" for name, us in ev.rule_us)
        out.write(f"Guards' time per check, µs (least of 3 rounds): {costs}.\n")
    out.write("\n")
    out.write("| threshold | precision | recall | false hits | precision (guards) | recall (guards) ")
    out.write("| false hits (guards) |\n|---|---|---|---|---|---|---|\n")
    for i, (p, g) in enumerate(zip(ev.plain, ev.guarded, strict=True)):
        if i % every and i != len(ev.plain) - 1:
            continue
        out.write(
            f"| {p.threshold:.2f} | {_pct(p.precision)} | {_pct(p.recall)} | {_pct(p.false_hit_rate)} "
            f"| {_pct(g.precision)} | {_pct(g.recall)} | {_pct(g.false_hit_rate)} |\n"
        )
    out.write("\n")
    for label, suggestion in (("without guards", ev.suggested_plain), ("with guards", ev.suggested_guarded)):
        if suggestion is None:
            out.write(f"Suggested threshold {label}: none keeps false hits within {_pct(ev.target_fhr)}.\n")
        else:
            out.write(
                f"Suggested threshold {label}: {suggestion.threshold:.2f} (false hits "
                f"{_pct(suggestion.false_hit_rate)}, recall {_pct(suggestion.recall)}, precision "
                f"{_pct(suggestion.precision)}; target {_pct(ev.target_fhr)}).\n"
            )
    if ev.verified:
        took = sorted(ev.verifier_seconds)
        late = sum(t >= ev.verifier_deadline_s for t in took) if ev.verifier_deadline_s else 0
        out.write(f"\nWith the verifier ({len(took)} calls, one at a time")
        if took:
            out.write(
                f"; each took p50 {1000 * _quantile(took, 0.5):.1f} ms, p95 {1000 * _quantile(took, 0.95):.1f} ms, "
                f"max {1000 * took[-1]:.1f} ms; {late} reached the deadline of {1000 * ev.verifier_deadline_s:.0f} ms"
            )
        out.write("):\n\n| threshold | precision | recall | false hits |\n|---|---|---|---|\n")
        for i, v in enumerate(ev.verified):
            if i % every and i != len(ev.verified) - 1:
                continue
            out.write(f"| {v.threshold:.2f} | {_pct(v.precision)} | {_pct(v.recall)} | {_pct(v.false_hit_rate)} |\n")
    threshold = at if at is not None else kinds_threshold(ev)
    out.write(f"\nBy kind, at threshold {threshold:.2f}:\n\n")
    out.write("| kind | should hit | pairs | median cosine | hit | hit (guards) | vetoed by guards ")
    out.write(f"| near misses (within {NEAR_MARGIN:.2f} under) | vetoes at the threshold, by guard |\n")
    out.write("|---|---|---|---|---|---|---|---|---|\n")
    for row in ev.kinds(threshold):
        said = ", ".join(f"{kind} {n}" for kind, n in row.vetoes) or "-"
        out.write(
            f"| {row.kind} | {'yes' if row.same else 'no'} | {row.pairs} | {row.median_cosine:.3f} "
            f"| {_pct(row.hits / row.pairs)} | {_pct(row.guarded_hits / row.pairs)} "
            f"| {_pct(row.vetoed / row.pairs)} | {row.near} | {said} |\n"
        )


def kinds_threshold(ev: Evaluation) -> float:
    """The threshold of the per-kind table unless one is asked for: the guarded suggestion, else 0.90."""
    at = ev.suggested_guarded or ev.suggested_plain
    return at.threshold if at is not None else 0.9


def _point_json(p: Point | None) -> dict[str, Any] | None:
    if p is None:
        return None
    return {
        "threshold": p.threshold,
        "precision": round(p.precision, 4),
        "recall": round(p.recall, 4),
        "false_hit_rate": round(p.false_hit_rate, 4),
        "true_hits": p.true_hits,
        "false_hits": p.false_hits,
    }


def as_json(ev: Evaluation, at: float | None = None) -> dict[str, Any]:
    """The figures as plain data: the curves, the suggestions and the per-kind table at the suggestion."""
    threshold = at if at is not None else kinds_threshold(ev)
    return {
        "pairs": len(ev.scored),
        "positives": ev.plain[0].positives,
        "negatives": ev.plain[0].negatives,
        "roc_auc": round(ev.roc_auc, 4),
        "guard_us_per_pair": round(ev.guard_seconds * 1e6, 1),
        "guard_us_per_check": dict(ev.rule_us),
        "target_fhr": ev.target_fhr,
        "curve": [_point_json(p) for p in ev.plain],
        "curve_guarded": [_point_json(p) for p in ev.guarded],
        "suggested": _point_json(ev.suggested_plain),
        "suggested_guarded": _point_json(ev.suggested_guarded),
        "curve_verified": [_point_json(p) for p in ev.verified],
        "verifier_ms": sorted(round(1000 * t, 2) for t in ev.verifier_seconds),
        "kinds_at": threshold,
        "kinds": [
            {
                "kind": r.kind,
                "same": r.same,
                "pairs": r.pairs,
                "median_cosine": round(r.median_cosine, 4),
                "hit_rate": round(r.hits / r.pairs, 4),
                "hit_rate_guarded": round(r.guarded_hits / r.pairs, 4),
                "vetoed": round(r.vetoed / r.pairs, 4),
                "near_misses": r.near,
                "vetoes": dict(r.vetoes),
            }
            for r in ev.kinds(threshold)
        ],
    }


def explain(ev: Evaluation, out: TextIO, threshold: float | None = None) -> None:
    """The pairs behind the figures at a threshold (the guarded suggestion by default): the false hits left, and
    the pairs that should hit and that the guards refused, with the kind of difference they saw."""
    if threshold is None:
        threshold = kinds_threshold(ev)
    wrong = [s for s in ev.scored if not s.pair.same and s.cosine >= threshold and s.veto is None]
    refused = [s for s in ev.scored if s.pair.same and s.cosine >= threshold and s.veto is not None]
    out.write(f"\nFalse hits with guards at {threshold:.2f} ({len(wrong)}):\n")
    for s in sorted(wrong, key=lambda s: -s.cosine):
        out.write(f"- {s.cosine:.3f} [{s.pair.kind}] {s.pair.a!r} / {s.pair.b!r}\n")
    out.write(f"\nPairs that should hit, refused by the guards at {threshold:.2f} ({len(refused)}):\n")
    for s in sorted(refused, key=lambda s: -s.cosine):
        out.write(f"- {s.cosine:.3f} [{s.veto}] {s.pair.a!r} / {s.pair.b!r}\n")
