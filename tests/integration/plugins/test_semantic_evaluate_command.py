"""`sluice cache evaluate` (alias of `sluice semantic evaluate`) end to end, with the real embedding model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import gateway
from plugins.semantic_cache.evaluation import HARD_SET
from tests.support.embedder import MODEL_NAME, EmbeddingServer
from tests.support.gateway import free_port

SMALL = [
    {"a": "How do I boil an egg?", "b": "What's the way to hard-boil an egg?", "same": True, "kind": "paraphrase"},
    {"a": "Can I freeze cooked pasta?", "b": "Is it okay to freeze cooked pasta?", "same": True, "kind": "paraphrase"},
    {"a": "Convert 5 km to miles", "b": "Convert 50 km to miles", "same": False, "kind": "number"},
    {"a": "Convert Celsius to Fahrenheit", "b": "Convert Fahrenheit to Celsius", "same": False, "kind": "order"},
]


def sluice(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def write_pairs(tmp_path: Path, rows: list[dict[str, Any]]) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_the_subprocess_runs_this_tree() -> None:
    here = Path(gateway.__file__).resolve().parent.parent
    found = sluice("--help", timeout=60)
    assert found.returncode == 0
    where = subprocess.run(
        [sys.executable, "-c", "import gateway; print(gateway.__file__)"], capture_output=True, text=True, check=True
    )
    assert Path(where.stdout.strip()).resolve().parent.parent == here


def test_evaluate_over_a_url_prints_the_curve(tmp_path: Path, embedder: EmbeddingServer) -> None:
    pairs = write_pairs(tmp_path, SMALL)
    done = sluice("cache", "evaluate", pairs, "--url", embedder.base_url, "--model", "mini")
    assert done.returncode == 0, done.stderr
    assert "4 pairs: 2 should hit, 2 must not." in done.stdout
    assert "| 0.70 |" in done.stdout
    assert "| 0.99 |" in done.stdout
    assert "Suggested threshold with guards:" in done.stdout
    assert "| number | no | 1 |" in done.stdout
    assert {r["model"] for r in embedder.requests} == {"mini"}
    # Each distinct text embedded once, in batches.
    assert sum(len(r["input"]) for r in embedder.requests) == 8


def test_both_names_of_the_command_give_the_same_figures(tmp_path: Path, embedder: EmbeddingServer) -> None:
    pairs = write_pairs(tmp_path, SMALL)
    alias = sluice("cache", "evaluate", pairs, "--url", embedder.base_url, "--model", "m", "--json")
    owner = sluice("semantic", "evaluate", pairs, "--url", embedder.base_url, "--model", "m", "--json")
    assert alias.returncode == owner.returncode == 0, alias.stderr + owner.stderr
    a, b = json.loads(alias.stdout), json.loads(owner.stdout)
    assert a["curve_guarded"] == b["curve_guarded"]
    assert a["curve"] == b["curve"]


def test_evaluate_through_a_model_of_the_config(tmp_path: Path, embedder: EmbeddingServer) -> None:
    # The gateway's own pipeline, in the command's process: the backend gets the config's upstream model name.
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f"backends:\n  emb: {{type: vllm, base_url: {embedder.base_url}}}\n"
        f"models:\n  embed-small: {{backend: emb, upstream_model: {MODEL_NAME}}}\n"
    )
    pairs = write_pairs(tmp_path, SMALL)
    done = sluice("cache", "evaluate", pairs, "-c", str(config), "--model", "embed-small", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["pairs"] == 4
    assert {r["model"] for r in embedder.requests} == {MODEL_NAME}
    unknown = sluice("cache", "evaluate", pairs, "-c", str(config), "--model", "nope")
    assert unknown.returncode == 2
    assert "no model named 'nope'" in unknown.stderr


def test_bad_input_and_a_dead_endpoint_end_in_one_line(tmp_path: Path) -> None:
    missing = sluice("cache", "evaluate", str(tmp_path / "none.jsonl"), "--url", "http://127.0.0.1:9/v1")
    assert missing.returncode == 2
    assert missing.stderr.startswith("sluice semantic evaluate: cannot read")
    pairs = write_pairs(tmp_path, SMALL)
    refused = sluice("cache", "evaluate", pairs, "--url", f"http://127.0.0.1:{free_port()}/v1", "--model", "m")
    assert refused.returncode == 1
    assert "cannot reach" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    wrong = sluice("cache", "evaluate", pairs, "--url", "http://127.0.0.1:9/v1", "--threshold", "1.5")
    assert wrong.returncode == 2
    assert wrong.stderr.strip() == (
        "sluice semantic evaluate: --threshold is a cosine similarity between 0 and 1, e.g. 0.85"
    )


def test_a_bundled_set_is_named_by_its_name(tmp_path: Path, embedder: EmbeddingServer) -> None:
    done = sluice("cache", "evaluate", "transformed-late", "--url", embedder.base_url, "--model", "m", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["pairs"] == 256


@pytest.fixture(scope="module")
def hard_report(embedding_model: Any) -> dict[str, Any]:
    """The bundled hard set through the real model over HTTP, as the docs' figures were measured."""
    with EmbeddingServer(embedding_model) as server:
        done = sluice("cache", "evaluate", "hard", "--url", server.base_url, "--model", MODEL_NAME, "--json")
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def test_the_hard_set_meets_the_target_with_guards_and_not_without(hard_report: dict[str, Any]) -> None:
    assert hard_report["pairs"] == len(HARD_SET.read_text().splitlines())
    guarded = hard_report["suggested_guarded"]
    assert guarded is not None
    assert guarded["false_hit_rate"] <= 0.02
    assert guarded["recall"] >= 0.40
    # The cosine alone never gets there: at every threshold, more than 2 % of the look-alikes hit.
    assert hard_report["suggested"] is None
    assert min(p["false_hit_rate"] for p in hard_report["curve"]) > 0.02


def test_direction_swaps_score_above_harmless_reorderings(hard_report: dict[str, Any]) -> None:
    # The trap a threshold cannot see: "X to Y" against "Y to X" is nearer than a mere reordering.
    median = {(k["kind"], k["same"]): k["median_cosine"] for k in hard_report["kinds"]}
    assert median[("order", False)] > median[("reorder", True)] > 0.95
    by_kind = {k["kind"]: k for k in hard_report["kinds"] if not k["same"]}
    assert by_kind["order"]["hit_rate_guarded"] == 0.0


# The rule-made sets (tools/semantic_pairs.py) and the hand-written sets at the default threshold, 0.80, with the
# default typo mending. "transformed", "natural", "forms" and "independent-dev" were tuned on; "transformed-holdout"
# and "transformed-late" were frozen and later tuned on; "natural-sealed" was frozen before any change and only ever
# read in total; "independent-sealed", "independent-sealed-2" and "independent-sealed-3" were written by hands that
# never saw the rules and only ever read in total: those four are the figures a user should expect on unseen
# traffic. The bounds are the measured figures with a little room, so that a rule change that costs accuracy
# fails here.
@pytest.mark.parametrize(
    ("name", "max_fhr", "min_recall"),
    [
        ("transformed", 0.02, 0.85),
        ("transformed-holdout", 0.02, 0.80),
        ("transformed-late", 0.02, 0.83),
        ("natural", 0.02, 0.60),
        ("natural-sealed", 0.03, 0.55),
        ("forms", 0.02, 0.77),
        ("independent-dev", 0.02, 0.53),
        ("independent-sealed", 0.02, 0.53),
        ("independent-sealed-2", 0.02, 0.53),
        ("independent-sealed-3", 0.04, 0.63),  # 3.1 % (5 of 160): over the target, measured once
    ],
)
def test_the_held_out_sets_at_the_default_threshold(
    name: str, max_fhr: float, min_recall: float, shared_embedder: EmbeddingServer
) -> None:
    done = sluice(
        "cache", "evaluate", name, "--url", shared_embedder.base_url, "--model", MODEL_NAME, "--json",
        "--threshold", "0.80",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    at = next(p for p in report["curve_guarded"] if p["threshold"] == 0.80)
    assert at["false_hit_rate"] <= max_fhr
    assert at["recall"] >= min_recall
    plain = next(p for p in report["curve"] if p["threshold"] == 0.80)
    assert plain["false_hit_rate"] > 0.30  # the cosine alone lets a third of the look-alikes through, or more
    assert report["kinds_at"] == 0.80
    if name.startswith(("natural", "independent")) or name == "forms":  # hand-written: not every kind in every set
        return
    kinds = {k["kind"]: k for k in report["kinds"]}
    for kind in ("scope", "affix", "negation", "antonym", "quantity"):
        assert kinds[kind]["hit_rate_guarded"] == 0.0, kind
    # Near misses and the guards' verdicts are counted for every kind.
    assert all("near_misses" in k and isinstance(k["vetoes"], dict) for k in report["kinds"])
    assert sum(kinds["swap"]["vetoes"].values()) > 0
    assert set(report["guard_us_per_check"]) >= {
        "profile",
        "roles",
        "source and target",
        "antonym",
        "affix",
        "instruction",
    }
