"""The rule-made pair sets: reproducible from their generator, the holdouts frozen and apart from the tuning set."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tools import semantic_pairs

PAIRS = Path(semantic_pairs.OUT)
# Changing a frozen set makes its figures meaningless: a new holdout needs new seeds and a new file.
FROZEN = {
    "transformed-holdout.jsonl": "15d79644978150f77a4af2f6a97af1f4e2b5cd1437fbddbe915e814b8943137e",
    "transformed-late.jsonl": "8dc1ea263903684aebaf556181d47711d4b3b998daf7abd62b39682989585e10",
    # Hand-written, frozen before any measurement (pairs/README.md); the sealed half is only ever read in total.
    "natural.jsonl": "e154057c1e292c01f3fb180cb54c6c5c640db72f6bd450d25ce0ff44e6acb735",
    "natural-sealed.jsonl": "a52bc1ec6ec2831f440d6f54a5b9fa05da2cf8499ff8a6612937939f3abf23a1",
    # Written by other hands than the rules' (pairs/README.md); the sealed one was never read pair by pair.
    "independent-dev.jsonl": "c6113fc992794e9458cf971cb1815d6651000fc59963f1aabd3767e16e3e0335",
    "independent-sealed.jsonl": "8d890c601f40c68f01fc2a5b2f0dfa2fe8c74c13619d5c03ac949359029146ba",
    "independent-sealed-2.jsonl": "fdabdebb0eeb538b730833b6c4119f5e84c20b5cfa504b0703c27dc38acf3d6c",
    "independent-sealed-3.jsonl": "86d4a8b6b5f64df14892b6357a739830c6c0e51af66aef4fee727bbb119aa21a",
}


@pytest.mark.parametrize(("name", "digest"), sorted(FROZEN.items()))
def test_the_holdouts_are_frozen(name: str, digest: str) -> None:
    assert hashlib.sha256((PAIRS / name).read_bytes()).hexdigest() == digest


def test_the_generator_writes_the_files_as_they_are(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(semantic_pairs, "OUT", tmp_path)
    semantic_pairs.main()
    for name in ("transformed.jsonl", "transformed-holdout.jsonl", "transformed-late.jsonl"):
        assert (tmp_path / name).read_bytes() == (PAIRS / name).read_bytes(), name


def rows(name: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in (PAIRS / name).read_text().splitlines()]


def test_no_pair_and_no_template_is_shared_between_tuning_and_holdout() -> None:
    tuning = {(r["a"], r["b"]) for r in rows("transformed.jsonl")}
    for name in ("transformed-holdout.jsonl", "transformed-late.jsonl"):
        held = {(r["a"], r["b"]) for r in rows(name)}
        assert not tuning & held
        assert not {a for a, _ in tuning} & {a for a, _ in held}  # whole templates are held out


def test_every_set_has_both_labels_and_every_rule() -> None:
    for name in ("transformed.jsonl", "transformed-holdout.jsonl", "transformed-late.jsonl"):
        kinds = {(r["same"], r["kind"]) for r in rows(name)}
        assert {k for same, k in kinds if same} == {"paraphrase", "typo", "shorthand", "synonym"}
        assert {k for same, k in kinds if not same} == {"swap", "scope", "affix", "negation", "antonym", "quantity"}


def test_the_transformations() -> None:
    assert semantic_pairs._shorthand("What's the way to get there with you?") == "whats the way to get there w/ u"
    assert semantic_pairs._negate("Which plants grow well?") is None
    assert semantic_pairs._negate("Which foods are safe?") == "Which foods are not safe?"
    assert semantic_pairs._negate("What fruits have vitamin C?") == "What fruits do not have vitamin C?"
    assert semantic_pairs._with_scope("How do vaccines work?", "briefly") == "How do vaccines work briefly?"
    assert semantic_pairs._synonym("Explain photosynthesis") == "Clarify photosynthesis"
