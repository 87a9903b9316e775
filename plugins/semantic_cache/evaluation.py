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

`sluice semantic evaluate FILE` (also `sluice cache evaluate FILE`) embeds the pairs through a model of the
gateway's config (`-c CONFIG --model NAME`: the gateway's own pipeline and pool, in this process) or any
OpenAI-compatible `/v1/embeddings` (`--url URL --model NAME`), and prints the curve and a per-kind table.
The bundled hard set is `plugins/semantic_cache/pairs/hard.jsonl` (`--file hard` names it).

`verify` is the optional verifier: a small chat model asked whether two requests need the same answer, bounded
by its own deadline (a timeout or a failure is "not the same", so the cache misses rather than guesses).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import httpx
import orjson

from plugins.semantic_cache.guards import CHECKS, SUBSTITUTION, compare, profile
from plugins.semantic_cache.verifier import agrees, question

if TYPE_CHECKING:
    from gateway.runtime import Runtime
    from gateway.settings import Settings

PAIRS = Path(__file__).parent / "pairs"
HARD_SET = PAIRS / "hard.jsonl"
# The bundled sets: (name, what it is). Tuned on: the guards were changed while they were measured on these.
BUNDLED = (
    ("hard", "hand-written look-alikes in 13 kinds; tuned on"),
    ("holdout", "hand-written noun swaps; tuned on since its first run"),
    ("transformed", "rule-made look-alikes (tools/semantic_pairs.py); tuned on"),
    ("transformed-holdout", "rule-made, held-out templates; run once, then one round of changes"),
    ("transformed-late", "rule-made from later seeds; frozen before the last changes, never tuned on"),
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


# -- the report


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


# -- embedding models


def _vectors(payload: Any, count: int) -> list[list[float]]:
    try:
        data = sorted(payload["data"], key=lambda d: d["index"])
        vectors = [[float(x) for x in d["embedding"]] for d in data]
    except (KeyError, TypeError, ValueError):
        raise EvaluationError("the embedding model's answer is not an OpenAI embeddings list", 1) from None
    if len(vectors) != count:
        raise EvaluationError(f"the embedding model returned {len(vectors)} vectors for {count} texts", 1)
    return vectors


def http_embedder(
    url: str, model: str, api_key: str = "", timeout_s: float = 120.0
) -> tuple[Embed, Callable[[], None]]:
    """An embedding function over any OpenAI-compatible `/v1/embeddings` (URL with or without the path)."""
    endpoint = url.rstrip("/")
    if not endpoint.endswith("/embeddings"):
        endpoint += "/embeddings"
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    client = httpx.Client(timeout=timeout_s, headers=headers)

    def embed(texts: Sequence[str]) -> list[list[float]]:
        try:
            response = client.post(endpoint, json={"model": model, "input": list(texts), "encoding_format": "float"})
        except httpx.HTTPError as exc:
            raise EvaluationError(f"cannot reach {endpoint}: {exc}", 1) from None
        if response.status_code != 200:
            raise EvaluationError(f"{endpoint} answered {response.status_code}: {response.text[:300]}", 1)
        return _vectors(response.json(), len(texts))

    return embed, client.close


async def _through_pipeline(runtime: Runtime, model: str, texts: Sequence[str]) -> list[list[float]]:
    """One embeddings request driven through the gateway's pipeline in this process, as a client's would be."""
    body = orjson.dumps({"model": model, "input": list(texts), "encoding_format": "float"})
    scope = {"type": "http", "method": "POST", "path": "/v1/embeddings", "headers": [(b"content-type", b"json")]}
    sent = False
    status = 0
    parts: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client never leaves
        raise AssertionError("unreachable")

    async def collect(message: MutableMapping[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        else:
            parts.append(message.get("body", b""))

    await runtime.intake.asgi(runtime.intake.openai, scope, receive, collect, "embeddings")
    answer = b"".join(parts)
    if status != 200:
        raise EvaluationError(f"model {model} answered {status}: {answer[:300].decode('utf-8', 'replace')}", 1)
    return _vectors(orjson.loads(answer), len(texts))


def config_embedder(settings: Settings, model: str) -> tuple[Embed, Callable[[], None]]:
    """An embedding function through the gateway's own pipeline (its providers, pool and routing), no plugins."""
    from gateway.runtime import Runtime

    if model not in settings.models:
        raise EvaluationError(f"no model named {model!r} in the config ({', '.join(sorted(settings.models))})")
    bare = settings.model_copy(update={"plugins": []})
    bare._plugin_config = {}
    loop = asyncio.new_event_loop()
    runtime = Runtime(bare)
    loop.run_until_complete(runtime.start())

    def embed(texts: Sequence[str]) -> list[list[float]]:
        return loop.run_until_complete(_through_pipeline(runtime, model, texts))

    def close() -> None:
        loop.run_until_complete(runtime.aclose())
        loop.close()

    return embed, close


# -- the optional verifier


async def verify(
    client: httpx.AsyncClient, url: str, model: str, a: str, b: str, deadline_s: float = 0.5, api_key: str = ""
) -> bool:
    """Whether a small chat model says the two requests need the same answer, within its own deadline.

    A timeout, an error or anything but a "yes" is False: the verifier can only turn a hit into a miss.
    """
    endpoint = url.rstrip("/")
    if not endpoint.endswith("/chat/completions"):
        endpoint += "/chat/completions"
    body = question(model, a, b)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with asyncio.timeout(deadline_s):
            response = await client.post(endpoint, json=body, headers=headers)
        if response.status_code != 200:
            return False
        answer = response.json()
    except (TimeoutError, httpx.HTTPError, ValueError):
        return False
    return agrees(answer)


# -- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    p = actions.add_parser("evaluate", help="precision, recall and false hits per threshold on labelled pairs")
    p.add_argument(
        "file",
        help='JSON Lines of {"a", "b", "same", "kind"}, or a bundled set: ' + ", ".join(name for name, _ in BUNDLED),
    )
    p.add_argument("-c", "--config", help="embed through this config's model (the gateway's own pipeline)")
    p.add_argument("--model", help="the embedding model: a model of the config, or the name sent to --url")
    p.add_argument("--url", help="an OpenAI-compatible base URL with /v1/embeddings, instead of the config")
    p.add_argument("--api-key", default="", help="a bearer key for --url")
    p.add_argument("--target-fhr", type=float, default=TARGET_FHR, help="false-hit rate to stay within (0.02)")
    p.add_argument("--every", type=int, default=1, help="print every n-th threshold of the curve (default 1)")
    p.add_argument("--explain", action="store_true", help="also list the false hits and the refused paraphrases")
    p.add_argument("--lenient", action="store_true", help="guards without the one-word substitution rule")
    p.add_argument(
        "--threshold", type=float, help="the threshold of the per-kind table and --explain (default: the suggestion)"
    )
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object instead of tables")
    p.add_argument("--verifier-url", help="also ask this OpenAI-compatible chat endpoint whether pairs match")
    p.add_argument("--verifier-model", default="default", help="the verifier's model name")
    p.add_argument("--verifier-deadline-ms", type=float, default=500.0, help="each verifier call's bound (500)")


async def _verified(args: argparse.Namespace, ev: Evaluation) -> Evaluation:
    deadline_s = args.verifier_deadline_ms / 1000
    async with httpx.AsyncClient() as client:

        async def ask(a: str, b: str) -> bool:
            return await verify(client, args.verifier_url, args.verifier_model, a, b, deadline_s, args.api_key)

        return await with_verifier(ev, ask, deadline_s)


def main(args: argparse.Namespace) -> int:
    name = "sluice semantic evaluate"
    try:
        if not 0 <= args.target_fhr <= 1:
            raise EvaluationError("--target-fhr is a fraction between 0 and 1, e.g. 0.02")
        if args.threshold is not None and not 0 < args.threshold <= 1:
            raise EvaluationError("--threshold is a cosine similarity between 0 and 1, e.g. 0.85")
        pairs = load_pairs(args.file)
        if args.url:
            embed, close = http_embedder(args.url, args.model or "default", args.api_key)
        else:
            from gateway.config import parse, read
            from gateway.settings import ConfigError

            if not args.model:
                raise EvaluationError("name the embedding model: --model NAME (a model of the config), or --url")
            try:
                settings = parse(*read(args.config))
            except ConfigError as exc:
                raise EvaluationError("; ".join(f"config error: {line}" for line in exc.lines)) from None
            embed, close = config_embedder(settings, args.model)
        try:
            evaluation = evaluate(pairs, embed, args.target_fhr, strict=not args.lenient)
        finally:
            close()
        if args.verifier_url:
            evaluation = asyncio.run(_verified(args, evaluation))
    except EvaluationError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return exc.code
    if args.json:
        sys.stdout.write(orjson.dumps(as_json(evaluation, args.threshold), option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        render(evaluation, sys.stdout, max(1, args.every), args.threshold)
        if args.explain:
            explain(evaluation, sys.stdout, args.threshold)
    return 0
