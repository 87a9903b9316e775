"""The semantic part of the `cache` scenario: a semantic hit against an exact hit, and what a semantic miss adds.

Three processes: `semantic-exact` (scenarios/cache.yaml: auth + the exact cache), `semantic` (the same plus the
semantic cache) and `semantic-hit` (auth + the semantic cache alone). The embedding model is on the `fast`
simulated upstream, which answers at once, so the figures are the gateway's own part: an embeddings round trip
through the warm pool, the search, the replay; a real embedding model adds its own latency on top (the
all-MiniLM-L6-v2 test server: ~25 ms a query on this machine, one BLAS thread).

- Hits: repeated prompts through `semantic-hit` (each a semantic hit at similarity 1, once stored) and through
  `semantic-exact` (each an L1 exact hit), taking turns on one schedule.
- Misses: prompts never sent before through `semantic-exact` and `semantic`, taking turns, paired request by
  request: the difference is what the semantic lookup (and its store, after the response) adds to a miss.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tools.bench.figures import Difference, Dist, dist, flat, ms, paired, pooled, stage_ms, us
from tools.bench.load import Lane, Workload, send_all, unique_workload, workload
from tools.bench.rig import LANE_WARM, Cells, GatewaySpec, Rig, add, rotated

EXACT = GatewaySpec("semantic-exact", "scenarios/cache.yaml")
MISS = GatewaySpec("semantic", "scenarios/semantic.yaml")
HIT = GatewaySpec("semantic-hit", "scenarios/semantic_hit.yaml")
RATE = 200.0
KINDS = (("stream", True), ("non-stream", False))
STORE_WAIT_S = 0.3  # entries are stored after each response: let the warm-up's land


@dataclass(frozen=True, slots=True)
class Hits:
    kind: str
    exact: Dist
    semantic: Dist
    vs_exact: Difference  # semantic hit - exact hit, per request
    hits: int  # responses of `semantic-hit` marked `x-sluice-cache: semantic`
    requests: int
    stage: Dist  # server-timing `semantic_cache;dur=` of the hits


@dataclass(frozen=True, slots=True)
class Misses:
    kind: str
    exact: Dist
    semantic: Dist
    added: Difference  # semantic - exact on prompts never sent before, per request
    stage: Dist  # `semantic_cache;dur=` of the misses
    false_hits: int  # never-sent prompts answered from another's entry (should be 0)


@dataclass(frozen=True, slots=True)
class Semantic:
    hits: list[Hits]
    misses: list[Misses]
    errors: int


def shape(rig: Rig, stream: bool) -> tuple[Workload, int]:
    o = rig.options
    tokens = o.tokens if stream else o.plain_tokens
    return workload("fast", stream, tokens, rig.auth_headers, deterministic=True), tokens


async def measure(rig: Rig) -> Semantic:
    o = rig.options
    cells: Cells = {}
    async with rig.phase("semantic", (EXACT, MISS, HIT)):
        for _, stream in KINDS:
            repeated, _ = shape(rig, stream)
            await send_all(rig.through(HIT.name).fast, repeated, LANE_WARM)
            await send_all(rig.through(EXACT.name).fast, repeated, LANE_WARM)
        await asyncio.sleep(STORE_WAIT_S)
        for number in range(o.rounds):
            for kind, stream in KINDS:
                repeated, tokens = shape(rig, stream)
                order = rotated([EXACT.name, HIT.name], number)
                lanes = [Lane(rig.through(name).fast, repeated, repeated) for name in order]
                for name, samples in zip(order, await rig.interleaved(lanes, RATE), strict=True):
                    add(cells, f"hit {kind}", RATE, name, samples)
                for repeat in range(o.comparisons):
                    order = rotated([EXACT.name, MISS.name], number * o.comparisons + repeat)
                    lanes = [
                        Lane(
                            rig.through(name).fast,
                            unique_workload("fast", stream, tokens, rig.count(RATE), rig.auth_headers),
                            repeated,
                        )
                        for name in order
                    ]
                    for name, samples in zip(order, await rig.interleaved(lanes, RATE), strict=True):
                        add(cells, f"miss {kind}", RATE, name, samples)
    return figures(cells)


def figures(cells: Cells) -> Semantic:
    hits, misses = [], []
    for kind, _ in KINDS:
        exact, semantic = cells[(f"hit {kind}", RATE, EXACT.name)], cells[(f"hit {kind}", RATE, HIT.name)]
        hits.append(
            Hits(
                kind,
                dist([s.latency for s in exact]),
                dist([s.latency for s in semantic]),
                paired(exact, semantic),
                sum(s.cache.get(b"semantic", 0) for s in semantic),
                sum(len(s.latency) for s in semantic),
                flat(stage_ms(pooled([s.timing for s in semantic]), "semantic_cache")),
            )
        )
        exact, semantic = cells[(f"miss {kind}", RATE, EXACT.name)], cells[(f"miss {kind}", RATE, MISS.name)]
        misses.append(
            Misses(
                kind,
                dist([s.latency for s in exact]),
                dist([s.latency for s in semantic]),
                paired(exact, semantic),
                flat(stage_ms(pooled([s.timing for s in semantic]), "semantic_cache")),
                sum(s.cache.get(b"semantic", 0) for s in semantic),
            )
        )
    errors = sum(s.errors for rounds in cells.values() for s in rounds)
    return Semantic(hits, misses, errors)


def render(c: Semantic) -> list[str]:
    return [
        f"## Semantic cache: a hit against an exact hit, and what it adds to a miss (@{RATE:g} req/s)",
        "",
        "The embedding model is the `fast` simulated upstream (it answers at once): these are the gateway's own "
        "part of a lookup; a real embedding model adds its latency on top. Streams: time to the first token; "
        "non-stream: the whole exchange. Differences are per request, paired within one interleaved schedule "
        "(range: over the cells' medians).",
        "",
        "| kind | exact hit p50 | semantic hit p50 | semantic - exact per request (µs; range) "
        "| semantic hits / requests | `semantic_cache;dur=` p50 (µs) |",
        "|---|---|---|---|---|---|",
        *(
            f"| {h.kind} | {ms(h.exact.p50)} | {ms(h.semantic.p50)} | {us(h.vs_exact.median)} ({us(h.vs_exact.low)} "
            f"to {us(h.vs_exact.high)}) | {h.hits} / {h.requests} | {us(h.stage.p50, signed=False)} |"
            for h in c.hits
        ),
        "",
        "| kind (miss: prompts never sent before) | auth + cache p50 | + semantic_cache p50 "
        "| added per request (µs; range) | `semantic_cache;dur=` p50 (µs) | false hits |",
        "|---|---|---|---|---|---|",
        *(
            f"| {m.kind} | {ms(m.exact.p50)} | {ms(m.semantic.p50)} | {us(m.added.median)} ({us(m.added.low)} to "
            f"{us(m.added.high)}) | {us(m.stage.p50, signed=False)} | {m.false_hits} |"
            for m in c.misses
        ),
    ]
