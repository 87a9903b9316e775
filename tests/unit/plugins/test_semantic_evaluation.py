"""The false-hit evaluation's arithmetic: pairs read, curves, the suggested threshold, ROC-AUC, the report."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

import pytest

from plugins.semantic_cache.evaluation import (
    HARD_SET,
    EvaluationError,
    Pair,
    evaluate,
    load_pairs,
    parse_pairs,
    suggest,
)
from plugins.semantic_cache.report import explain, render


def unit(angle_deg: float) -> list[float]:
    """A 2-D unit vector: the cosine of two of them is the cosine of the angle between them."""
    return [math.cos(math.radians(angle_deg)), math.sin(math.radians(angle_deg))]


# Each text's vector is chosen so that each pair's cosine is known: "x" is at 0 degrees.
ANGLES = {
    "x": 0.0,
    "p1": math.degrees(math.acos(0.95)),  # paraphrase at 0.95
    "p2": math.degrees(math.acos(0.85)),  # paraphrase at 0.85
    "p3": math.degrees(math.acos(0.75)),  # paraphrase at 0.75
    "n1": math.degrees(math.acos(0.97)),  # negative at 0.97, which the guards veto (a number differs)
    "n2": math.degrees(math.acos(0.80)),  # negative at 0.80, which only the strict guards veto (a substitution)
}
TEXTS = {
    "x": "How do I boil 2 eggs?",
    "p1": "What's the way to boil 2 eggs?",
    "p2": "Boiling 2 eggs: how?",
    "p3": "Tell me how to boil two eggs",
    "n1": "How do I boil 3 eggs?",
    "n2": "How do I poach 2 eggs?",
}
BY_TEXT = {text: unit(ANGLES[key]) for key, text in TEXTS.items()}
PAIRS = [
    Pair(TEXTS["x"], TEXTS["p1"], True, "paraphrase"),
    Pair(TEXTS["x"], TEXTS["p2"], True, "paraphrase"),
    Pair(TEXTS["x"], TEXTS["p3"], True, "paraphrase"),
    Pair(TEXTS["x"], TEXTS["n1"], False, "number"),
    Pair(TEXTS["x"], TEXTS["n2"], False, "verb"),
]


def embed(texts: Sequence[str]) -> list[list[float]]:
    return [BY_TEXT[t] for t in texts]


def test_curves_count_hits_with_and_without_guards() -> None:
    ev = evaluate(PAIRS, embed, thresholds=[0.70, 0.80, 0.90, 0.96, 0.99], strict=False)
    plain = {p.threshold: p for p in ev.plain}
    guarded = {p.threshold: p for p in ev.guarded}
    assert (plain[0.70].true_hits, plain[0.70].false_hits) == (3, 2)
    assert (guarded[0.70].true_hits, guarded[0.70].false_hits) == (3, 1)  # n1 vetoed: 2 eggs / 3 eggs
    assert plain[0.80].false_hit_rate == 1.0  # n2 sits exactly at 0.80: a cosine at the threshold hits
    assert guarded[0.90].false_hit_rate == 0.0
    assert guarded[0.90].recall == pytest.approx(1 / 3)
    assert plain[0.96].precision == 0.0  # only n1 reaches 0.96
    assert plain[0.99].hits == 0
    assert plain[0.99].precision == 1.0  # no hit, no wrong hit
    assert [s.veto for s in ev.scored] == [None, None, None, "number", None]


def test_the_suggestion_is_the_best_recall_within_the_target() -> None:
    ev = evaluate(PAIRS, embed, target_fhr=0.0, thresholds=[0.70, 0.80, 0.81, 0.90, 0.99], strict=False)
    assert ev.suggested_guarded is not None
    assert ev.suggested_guarded.threshold == 0.81  # the lowest threshold above n2 with recall 2/3
    assert ev.suggested_plain is None  # n1 at 0.97 is above every paraphrase: no threshold keeps it out
    assert suggest(ev.guarded, target_fhr=0.5) is not None
    assert suggest(ev.guarded, target_fhr=0.5).threshold == 0.70  # type: ignore[union-attr]


def test_strict_guards_also_veto_a_one_word_substitution() -> None:
    ev = evaluate(PAIRS, embed, thresholds=[0.70])
    assert [s.veto for s in ev.scored] == [None, None, None, "number", "substitution"]
    assert ev.guarded[0].false_hits == 0


def test_roc_auc_of_the_cosine() -> None:
    ev = evaluate(PAIRS, embed)
    # Pairs (positive, negative) ordered right: p1 > n2, p2 > n2 (2 of 6); n1 is above every positive.
    assert ev.roc_auc == pytest.approx(2 / 6)


def test_the_report_has_the_curve_the_suggestion_and_the_kinds() -> None:
    out = io.StringIO()
    render(evaluate(PAIRS, embed, strict=False), out, every=10)
    text = out.getvalue()
    assert "| 0.70 |" in text
    assert "| 0.80 |" in text
    assert "| 0.99 |" in text
    assert "| 0.75 |" not in text
    assert "Suggested threshold with guards: 0.81" in text
    assert "| number | no | 1 |" in text


def test_explain_lists_the_pairs_behind_the_figures() -> None:
    out = io.StringIO()
    explain(evaluate(PAIRS, embed, strict=False), out, threshold=0.70)
    text = out.getvalue()
    assert "False hits with guards at 0.70 (1):" in text
    assert "0.800 [verb] 'How do I boil 2 eggs?' / 'How do I poach 2 eggs?'" in text
    assert "refused by the guards at 0.70 (0):" in text


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"a": "x", "b": "y"}', "expected"),
        ('{"a": "", "b": "y", "same": true}', "expected"),
        ('{"a": "x", "b": "y", "same": "yes"}', "expected"),
    ],
)
def test_bad_pair_files_name_the_line(line: str, message: str) -> None:
    with pytest.raises(EvaluationError, match=f"pairs.jsonl:2: {message}"):
        parse_pairs(['{"a": "p", "b": "q", "same": true}', line], "pairs.jsonl")


def test_a_file_needs_both_labels() -> None:
    with pytest.raises(EvaluationError, match="needs pairs that should hit and pairs that must not"):
        parse_pairs(['{"a": "p", "b": "q", "same": true}'], "pairs.jsonl")


def test_the_bundled_hard_set() -> None:
    pairs = load_pairs("hard")
    assert load_pairs(HARD_SET) == pairs
    assert len(pairs) >= 320
    assert sum(p.same for p in pairs) == len(pairs) // 2
    negative_kinds = {p.kind for p in pairs if not p.same}
    assert {"number", "entity", "negation", "unit", "order", "language", "scope", "date"} <= negative_kinds
    assert len({(p.a, p.b) for p in pairs}) == len(pairs)  # no pair twice
