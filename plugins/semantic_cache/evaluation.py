"""Measuring false hits: labelled prompt pairs, an embedding model, the guards, and what a threshold would do.

A pair file is JSON Lines, one `{"a": ..., "b": ..., "same": true|false, "kind": "..."}` a line: `same` says
whether one cached answer serves both prompts; `kind` names what the pair tests ("paraphrase", "number", ...).
For every pair the cosine of the two prompts' embeddings and the guards' verdict (plugins/semantic_cache/
guards.py) are computed once; then for each threshold from 0.70 to 0.99, with and without guards:

- a hit is a pair whose cosine reaches the threshold (and, guarded, that no guard vetoes);
- precision = true hits / hits, recall = true hits / pairs that should hit, and the false-hit rate =
  false hits / pairs that must not hit (what a user of the cache meets: the share of look-alike prompts that
  get someone else's answer);
- the suggested threshold is the one with the highest recall among those whose false-hit rate is within the
  target (default 2 %), the lowest such threshold on a tie.

`sluice semantic evaluate FILE` (also `sluice cache evaluate FILE`; command.py) embeds the pairs through a model
of the gateway's config or any OpenAI-compatible `/v1/embeddings`, and prints (report.py) the curve and a
per-kind table. The bundled sets are in `plugins/semantic_cache/pairs/` (`BUNDLED` names them).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from plugins.semantic_cache.guards import CHECKS, SUBSTITUTION, compare, profile

PAIRS = Path(__file__).parent / "pairs"
HARD_SET = PAIRS / "hard.jsonl"
# The bundled sets: (name, what it is). Tuned on: the guards were changed while they were measured on these.
BUNDLED = (
    ("hard", "hand-written look-alikes in 13 kinds; tuned on"),
    ("holdout", "hand-written noun swaps; tuned on since its first run"),
    ("transformed", "rule-made look-alikes (tools/semantic_pairs.py); tuned on"),
    ("transformed-holdout", "rule-made, held-out templates; run once, then one round of changes"),
    ("transformed-late", "rule-made from later seeds; frozen, unseen for two rounds, then tuned on"),
    ("natural", "hand-written everyday requests in other domains; frozen, measured, then tuned on"),
    ("natural-sealed", "the other half of the natural pairs; frozen, only ever read in total, never tuned on"),
    ("forms", "hand-written look-alikes of scope, form and roles, written to probe the rules; tuned on"),
    ("independent-dev", "written by another hand than the rules', 16 kinds; tuned on"),
    ("independent-sealed", "written by a third hand, never shown to the rules' author; frozen, totals only"),
    ("independent-sealed-2", "written by a fourth hand after the rules were final; frozen, measured once"),
    ("independent-sealed-3", "written by a fifth hand, a later day, the rules unchanged; frozen, measured once"),
)
THRESHOLDS = tuple(round(0.70 + i / 100, 2) for i in range(30))  # 0.70 .. 0.99
TARGET_FHR = 0.02
NEAR_MARGIN = 0.1  # as the plugin's near_margin: a best match this far under the threshold is a near miss
BATCH = 64  # texts per embeddings request

Embed = Callable[[Sequence[str]], Sequence[Sequence[float]]]


class EvaluationError(Exception):
    """Bad input or an unreachable model: one line for the user, exit code 2 (input) or 1 (the model)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Pair:
    a: str
    b: str
    same: bool
    kind: str


@dataclass(frozen=True, slots=True)
class Scored:
    pair: Pair
    cosine: float
    veto: str | None  # the guards' verdict: None, or the kind of difference that vetoes
    verified: bool | None = None  # the verifier's verdict, for the pairs it was asked about


@dataclass(frozen=True, slots=True)
class Point:
    """What one threshold does to the pairs, with or without guards."""

    threshold: float
    guarded: bool
    true_hits: int
    false_hits: int
    positives: int
    negatives: int

    @property
    def hits(self) -> int:
        return self.true_hits + self.false_hits

    @property
    def precision(self) -> float:
        return self.true_hits / self.hits if self.hits else 1.0

    @property
    def recall(self) -> float:
        return self.true_hits / self.positives if self.positives else 0.0

    @property
    def false_hit_rate(self) -> float:
        return self.false_hits / self.negatives if self.negatives else 0.0


@dataclass(frozen=True, slots=True)
class KindRow:
    """One kind of pair at one threshold: how many hit, with and without guards, and its cosines."""

    kind: str
    same: bool
    pairs: int
    hits: int
    guarded_hits: int
    vetoed: int  # pairs of this kind the guards veto, whatever their cosine
    median_cosine: float
    near: int = 0  # pairs just under the threshold (within NEAR_MARGIN): what a lower threshold would add
    vetoes: tuple[tuple[str, int], ...] = ()  # of the pairs at or above the threshold, what the guards said


@dataclass(frozen=True, slots=True)
class Evaluation:
    scored: tuple[Scored, ...]
    plain: tuple[Point, ...]
    guarded: tuple[Point, ...]
    target_fhr: float
    suggested_plain: Point | None
    suggested_guarded: Point | None
    roc_auc: float  # of the cosine alone: the chance a random should-hit pair scores above a must-not pair
    guard_seconds: float  # the guards' time per pair (both prompts profiled, then compared)
    rule_us: tuple[tuple[str, float], ...] = ()  # each rule's time per check, and a profile's, in µs
    verified: tuple[Point, ...] = ()  # guards, then the verifier on what they let through (when one was asked)
    verifier_seconds: tuple[float, ...] = ()  # each verifier call's time
    verifier_deadline_s: float = 0.0

    def kinds(self, threshold: float) -> list[KindRow]:
        return kind_table(self.scored, threshold)


# -- pairs


def parse_pairs(lines: Iterable[str], source: str) -> list[Pair]:
    pairs: list[Pair] = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            row = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise EvaluationError(f"{source}:{number}: not valid JSON: {exc}") from None
        if not (
            isinstance(row, dict)
            and isinstance(row.get("a"), str)
            and isinstance(row.get("b"), str)
            and row["a"].strip()
            and row["b"].strip()
            and isinstance(row.get("same"), bool)
        ):
            raise EvaluationError(f'{source}:{number}: expected {{"a": text, "b": text, "same": true|false}}')
        kind = row.get("kind", "paraphrase" if row["same"] else "negative")
        pairs.append(Pair(row["a"], row["b"], row["same"], str(kind)))
    if not any(p.same for p in pairs) or all(p.same for p in pairs):
        raise EvaluationError(f"{source}: needs pairs that should hit and pairs that must not")
    return pairs


def load_pairs(path: str | Path) -> list[Pair]:
    """The pairs of a JSON Lines file; a bare name ("hard", "transformed-holdout") names a bundled set."""
    bundled = PAIRS / f"{path}.jsonl"
    path = bundled if "/" not in str(path) and not str(path).endswith(".jsonl") and bundled.exists() else Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise EvaluationError(f"cannot read {path}: {exc.strerror}") from None
    return parse_pairs(text.splitlines(), str(path))


# -- scoring


def cosine(u: Sequence[float], v: Sequence[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(u, v, strict=True))
    norm = math.sqrt(math.fsum(x * x for x in u)) * math.sqrt(math.fsum(y * y for y in v))
    return dot / norm if norm else 0.0


def score(pairs: Sequence[Pair], embed: Embed, strict: bool = True) -> tuple[list[Scored], float]:
    """Each pair's cosine (each distinct text embedded once) and guard verdict; and the guards' time per pair."""
    texts = list(dict.fromkeys(t for p in pairs for t in (p.a, p.b)))
    vectors: dict[str, Sequence[float]] = {}
    for start in range(0, len(texts), BATCH):
        batch = texts[start : start + BATCH]
        got = embed(batch)
        if len(got) != len(batch):
            raise EvaluationError(f"the embedding model returned {len(got)} vectors for {len(batch)} texts", 1)
        vectors.update(zip(batch, got, strict=True))
    started = time.perf_counter()
    verdicts = [compare(profile(p.a), profile(p.b), strict) for p in pairs]
    guard_seconds = (time.perf_counter() - started) / len(pairs)
    scored = [Scored(p, cosine(vectors[p.a], vectors[p.b]), v) for p, v in zip(pairs, verdicts, strict=True)]
    return scored, guard_seconds


def point(scored: Sequence[Scored], threshold: float, guarded: bool, verified: bool = False) -> Point:
    true_hits = false_hits = 0
    for s in scored:
        if s.cosine >= threshold and not (guarded and s.veto) and not (verified and s.verified is not True):
            if s.pair.same:
                true_hits += 1
            else:
                false_hits += 1
    positives = sum(s.pair.same for s in scored)
    return Point(threshold, guarded, true_hits, false_hits, positives, len(scored) - positives)


def suggest(points: Sequence[Point], target_fhr: float = TARGET_FHR) -> Point | None:
    """The highest recall whose false-hit rate is within the target; the lowest threshold on a tie."""
    within = [p for p in points if p.false_hit_rate <= target_fhr and p.true_hits > 0]
    if not within:
        return None
    return max(within, key=lambda p: (p.recall, -p.threshold))


def roc_auc(scored: Sequence[Scored]) -> float:
    """The probability that a should-hit pair's cosine is above a must-not pair's (ties count half)."""
    ranked = sorted(scored, key=lambda s: s.cosine)
    positives = sum(s.pair.same for s in scored)
    negatives = len(scored) - positives
    if not positives or not negatives:
        return float("nan")
    rank_sum = 0.0
    i = 0
    while i < len(ranked):  # average ranks over ties
        j = i
        while j + 1 < len(ranked) and ranked[j + 1].cosine == ranked[i].cosine:
            j += 1
        rank = (i + j) / 2 + 1
        rank_sum += rank * sum(ranked[k].pair.same for k in range(i, j + 1))
        i = j + 1
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def kind_table(scored: Sequence[Scored], threshold: float) -> list[KindRow]:
    by_kind: dict[tuple[bool, str], list[Scored]] = {}
    for s in scored:
        by_kind.setdefault((not s.pair.same, s.pair.kind), []).append(s)
    rows = []
    for (negative, kind), group in sorted(by_kind.items()):
        hits = [s for s in group if s.cosine >= threshold]
        said: dict[str, int] = {}
        for s in hits:
            if s.veto is not None:
                said[s.veto] = said.get(s.veto, 0) + 1
        rows.append(
            KindRow(
                kind=kind,
                same=not negative,
                pairs=len(group),
                hits=len(hits),
                guarded_hits=sum(s.veto is None for s in hits),
                vetoed=sum(s.veto is not None for s in group),
                median_cosine=statistics.median(s.cosine for s in group),
                near=sum(threshold - NEAR_MARGIN <= s.cosine < threshold for s in group),
                vetoes=tuple(sorted(said.items(), key=lambda kv: (-kv[1], kv[0]))),
            )
        )
    return rows


def evaluate(
    pairs: Sequence[Pair],
    embed: Embed,
    target_fhr: float = TARGET_FHR,
    thresholds: Sequence[float] = THRESHOLDS,
    strict: bool = True,
) -> Evaluation:
    """Score the pairs (guards in strict mode unless told) and compute the curves and the suggestions."""
    scored, guard_seconds = score(pairs, embed, strict)
    plain = tuple(point(scored, t, guarded=False) for t in thresholds)
    guarded = tuple(point(scored, t, guarded=True) for t in thresholds)
    return Evaluation(
        scored=tuple(scored),
        plain=plain,
        guarded=guarded,
        target_fhr=target_fhr,
        suggested_plain=suggest(plain, target_fhr),
        suggested_guarded=suggest(guarded, target_fhr),
        roc_auc=roc_auc(scored),
        guard_seconds=guard_seconds,
        rule_us=rule_costs(pairs),
    )


def rule_costs(pairs: Sequence[Pair], rounds: int = 3) -> tuple[tuple[str, float], ...]:
    """Each guard rule's time per check over the pairs (the least of a few rounds, as the machine's load only
    adds), and a profile's: what a lookup pays for the query's profile and for each rule it reaches."""
    profiles = [(profile(p.a), profile(p.b)) for p in pairs]
    best: dict[str, float] = {}
    texts = [t for p in pairs for t in (p.a, p.b)]
    for _ in range(rounds):
        started = time.perf_counter()
        for text in texts:
            profile(text)
        best["profile"] = min(best.get("profile", math.inf), (time.perf_counter() - started) / len(texts))
        for name, _kind, check in (*CHECKS, SUBSTITUTION):
            started = time.perf_counter()
            for a, b in profiles:
                check(a, b)
            took = (time.perf_counter() - started) / len(profiles)
            best[name] = min(best.get(name, math.inf), took)
    return tuple((name, round(seconds * 1e6, 2)) for name, seconds in best.items())


Verifier = Callable[[str, str], Awaitable[bool]]


async def with_verifier(ev: Evaluation, verifier: Verifier, deadline_s: float = 0.0) -> Evaluation:
    """`ev` plus the verifier's verdict on each pair the guards let through at the lowest threshold, asked one
    call at a time (so that each call's time is its own, as on a request path), and the curve it gives."""
    scored: list[Scored] = []
    took: list[float] = []
    floor = ev.plain[0].threshold
    for s in ev.scored:
        if s.veto is None and s.cosine >= floor:
            started = time.perf_counter()
            verdict = await verifier(s.pair.a, s.pair.b)
            took.append(time.perf_counter() - started)
            s = dataclasses.replace(s, verified=verdict)
        scored.append(s)
    verified = tuple(point(scored, p.threshold, guarded=True, verified=True) for p in ev.plain)
    return dataclasses.replace(
        ev, scored=tuple(scored), verified=verified, verifier_seconds=tuple(took), verifier_deadline_s=deadline_s
    )
