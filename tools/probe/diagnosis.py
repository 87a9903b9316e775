"""The troubleshooting table as code: measurements in, findings out (cause, stage, advice, evidence).

Each rule reads the summary of one side of the probe (or the direct/via comparison) and fires only when a
figure is off both relative to another figure of the same run and by an absolute margin, so that a fast,
healthy endpoint yields no finding rather than a made-up one. docs/latency-troubleshooting.md is the same
table for people.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.telemetry.quantiles import percentile
from tools.probe.summary import Cell, Comparison, TargetSummary, cold_extra, find, first_mark

# Thresholds: (relative, absolute). Chosen so that loopback jitter and ordinary model behaviour stay quiet.
COLD_RATIO, COLD_MIN_MS = 3.0, 50.0  # cold > 3x warm and > +50 ms
SETUP_SHARE, SETUP_MIN_MS = 0.2, 30.0  # a new connection adds >= 20% of a reused request's TTFT and >= 30 ms
QUEUE_TPOT_RATIO, QUEUE_MIN_MS = 10.0, 200.0  # server time to first token >= 10 decode steps and >= 200 ms
BUFFER_TAIL_SHARE, BUFFER_MIN_MS, BUFFER_MIN_TOKENS = 0.1, 50.0, 5
PREFILL_RATIO, PREFILL_MIN_MS = 2.0, 100.0  # long-prompt TTFT >= 2x minimal and >= +100 ms
CACHE_RATIO, CACHE_MIN_MS = 2.0, 50.0  # a prompt's first TTFT >= 2x its repeats' and >= +50 ms
JITTER_MIN_GAPS = 50  # fewer gaps (a minimal-only run) make p90 a matter of two or three reads
JITTER_P90_RATIO, JITTER_P90_MIN_MS = 3.0, 20.0
JITTER_MAX_RATIO, JITTER_MAX_MIN_MS = 10.0, 250.0
GATEWAY_SHARE, GATEWAY_MIN_MS = 0.2, 25.0
KEEPALIVE_LOST_SHARE = 0.5
TPOT_FLOOR_MS = 1.0  # below this, gaps are read timing, not decode steps


@dataclass(frozen=True, slots=True)
class Finding:
    target: str  # "direct", "via" or "comparison"
    code: str  # a stable name for scripts: connection_reuse, queueing, cold_start, buffering, ...
    cause: str  # the likely cause, in plain words
    stage: str  # the stage of the request it lives in (probe_summary.STAGES, or "stream", "gateway")
    summary: str  # what was seen, with the figures
    advice: str  # what to check or change
    evidence: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        evidence = {k: round(v, 3) if isinstance(v, float) else v for k, v in self.evidence.items()}
        return {
            "target": self.target,
            "code": self.code,
            "cause": self.cause,
            "stage": self.stage,
            "summary": self.summary,
            "advice": self.advice,
            "evidence": evidence,
        }


Rule = Callable[[TargetSummary], Finding | None]


def diagnose(targets: list[TargetSummary], comparison: Comparison | None) -> list[Finding]:
    findings: list[Finding] = []
    for target in targets:
        buffered = _buffering(target)
        if buffered is not None:
            findings.append(buffered)
        # A buffered stream's first token marks the end of the answer: TTFT rules would misread it.
        rules: list[Rule] = [_cold_start, _connection_reuse, _keepalive, _contention]
        if buffered is None:
            rules += [_queueing, _prefill, _prompt_cache]
        findings += [found for rule in rules if (found := rule(target)) is not None]
    if comparison is not None and len(targets) == 2:
        found = _gateway_overhead(comparison, targets[1])
        if found is not None:
            findings.append(found)
    return findings


def _warm_minimal(target: TargetSummary) -> Cell | None:
    return find(target.cells, "minimal", True, "reused") or find(target.cells, "minimal", True, "fresh")


def _tpot(target: TargetSummary) -> float | None:
    """Time per output token, from the streamed cell with the most tokens."""
    cells = [c for c in target.cells if c.stream and c.count and c.p50("tpot_ms") is not None]
    if not cells:
        return None
    return max(cells, key=lambda c: c.tokens or 0).p50("tpot_ms")


def _cold_start(target: TargetSummary) -> Finding | None:
    warm = find(target.cells, "minimal", True, "fresh")
    extra = cold_extra(target.cold, target.cells)
    if target.cold is None or warm is None or extra is None:
        return None
    cold = first_mark(target.cold)
    base = warm.p50("ttft_ms") if target.cold.ttft_ms is not None else warm.p50("total_ms")
    if cold is None or base is None or cold < COLD_RATIO * base or extra < COLD_MIN_MS:
        return None
    return Finding(
        target.name,
        "cold_start",
        "cold start: the first request pays for loading, compiling or scaling up",
        "cold_start",
        f"the first request took {cold:.0f} ms to its first token, warm requests on a new connection "
        f"{base:.0f} ms (p50): {cold / max(base, 0.001):.1f}x, +{extra:.0f} ms",
        "warm the endpoint up before traffic: send a request at start-up and after each deploy or scale-up; "
        "keep a minimum number of replicas; for serverless backends keep them warm; in Sluice, "
        "pool.warm_connections opens upstream connections at start-up",
        {"cold_ms": cold, "warm_p50_ms": base, "extra_ms": extra, "cold_connect_ms": target.cold.connect_ms},
    )


def _connection_reuse(target: TargetSummary) -> Finding | None:
    fresh = find(target.cells, "minimal", True, "fresh")
    reused = find(target.cells, "minimal", True, "reused")
    cost = target.floor.components.get("connection")
    if fresh is None or reused is None or cost is None:
        return None
    base = reused.p50("ttft_ms") or reused.p50("total_ms") or 0.0
    if cost < SETUP_MIN_MS or cost < SETUP_SHARE * base:
        return None
    handshake = target.floor.fresh.get("tcp") or 0.0
    handshake += target.floor.fresh.get("tls") or 0.0
    handshake += target.floor.fresh.get("dns") or 0.0
    where = (
        "in DNS, TCP and TLS handshakes"
        if handshake >= cost / 2
        else "after the handshake: the server or a proxy in front of it is slow to serve a new connection"
    )
    return Finding(
        target.name,
        "connection_reuse",
        "connections are not reused: every new connection pays its setup again",
        "connection",
        f"a new connection adds {cost:.0f} ms before the response head ({where}); a reused one reaches "
        f"the first token in {base:.0f} ms (p50)",
        "keep connections alive and pool them in the client (one long-lived client object, not one per request; "
        "httpx.Client / openai.OpenAI reused); check that proxies and load balancers keep idle connections "
        "open longer than the client does; behind Sluice, its upstream pool does this for you",
        {
            "connection_cost_ms": cost,
            "handshake_ms": handshake,
            "fresh_ttfb_p50_ms": fresh.p50("ttfb_ms"),
            "reused_ttfb_p50_ms": reused.p50("ttfb_ms"),
            "reused_ttft_p50_ms": base,
            "tpot_p50_ms": _tpot(target),
        },
    )


def _keepalive(target: TargetSummary) -> Finding | None:
    planned, lost = target.reuse_planned, target.reuse_lost
    if not planned or lost < KEEPALIVE_LOST_SHARE * planned:
        return None
    return Finding(
        target.name,
        "no_keepalive",
        "the server closes connections after each answer, so none can be reused",
        "connection",
        f"{lost} of {planned} requests meant for a kept-alive connection found it closed",
        "check `connection: close` in answers, keep-alive timeouts and request limits per connection on the "
        "server and on proxies in front of it",
        {"planned": planned, "lost": lost},
    )


def _queueing(target: TargetSummary) -> Finding | None:
    cell = _warm_minimal(target)
    if cell is None:
        return None
    sent, head = cell.p50("sent_ms") or 0.0, cell.p50("ttfb_ms")
    first = cell.p50("ttft_ms") or head
    tpot = _tpot(target)
    if head is None or first is None:
        return None
    server = first - sent
    step = max(tpot or 0.0, TPOT_FLOOR_MS)
    connection = target.floor.components.get("connection", 0.0)
    if server < QUEUE_MIN_MS or server < QUEUE_TPOT_RATIO * step or connection >= server / 2:
        return None
    head_wait = head - sent
    held = head_wait >= first - head
    return Finding(
        target.name,
        "queueing",
        "time is spent at the server before the first token: a queue, or prefill",
        "head" if held else "first_token",
        f"the server takes {server:.0f} ms to the first token of a minimal prompt "
        f"({server / step:.0f}x the time per output token); "
        + (
            f"even the response head waits {head_wait:.0f} ms"
            if held
            else f"the head comes after {head_wait:.0f} ms, the first token {first - head:.0f} ms later"
        ),
        "check the server's queue and concurrency (vLLM: num_requests_waiting, max_num_seqs; rate-limit tier "
        "and region for hosted APIs), admission queues in load balancers or gateways in front of it, and the "
        "prompt length; add capacity or route to a less loaded deployment",
        {"server_ms": server, "head_wait_ms": head_wait, "tpot_p50_ms": tpot, "connection_cost_ms": connection},
    )


def _buffering(target: TargetSummary) -> Finding | None:
    streams = [c for c in target.cells if c.stream and c.count and (c.tokens or 0) >= BUFFER_MIN_TOKENS]
    if not streams:
        return None
    cell = max(streams, key=lambda c: c.tokens or 0)
    head, first, total = cell.p50("ttfb_ms"), cell.p50("ttft_ms"), cell.p50("total_ms")
    whole = find(target.cells, cell.probe, False, cell.connection)
    whole_total = whole.p50("total_ms") if whole is not None else None
    if head is None or first is None or total is None or total < BUFFER_MIN_MS:
        return None
    if total - first > BUFFER_TAIL_SHARE * total or (whole_total is not None and first < 0.8 * whole_total):
        return None
    # The head came early and the body late (a proxy holding the body), or the head too waited while many
    # tokens then arrived at once, faster than any model writes them.
    held_body = first - head >= 0.5 * first
    tokens = cell.tokens or 0
    if not held_body and (tokens < 20 or (total - first) / (tokens - 1) >= TPOT_FLOOR_MS / 2):
        return None
    return Finding(
        target.name,
        "buffering",
        "a buffering proxy: the stream is held back and delivered at the end",
        "first_token",
        f"{cell.probe} streams reach their first token at {first:.0f} ms of {total:.0f} ms (p50), "
        f"{tokens:.0f} tokens arrive together; a non-streamed answer takes "
        + (f"{whole_total:.0f} ms" if whole_total is not None else "about as long"),
        "look for a hop that buffers responses: nginx `proxy_buffering off` (or `X-Accel-Buffering: no`), "
        "gzip or other compression of text/event-stream, API gateways or WAFs that read whole bodies, "
        "HTTP clients that read the whole body before iterating; Sluice relays chunks as they arrive",
        {
            "probe": cell.probe,
            "ttfb_p50_ms": head,
            "ttft_p50_ms": first,
            "total_p50_ms": total,
            "non_stream_total_p50_ms": whole_total,
            "tokens_p50": tokens,
        },
    )


def _long_warm(target: TargetSummary) -> Cell | None:
    return find(target.cells, "long", True, "reused") or find(target.cells, "long", True, "fresh")


def _prefill(target: TargetSummary) -> Finding | None:
    short, long = _warm_minimal(target), _long_warm(target)
    if short is None or long is None:
        return None
    a, warm = short.p50("ttft_ms"), long.p50("ttft_ms")
    # Behind a prompt cache (llama.cpp, vLLM's prefix caching) repeats of the long prompt skip its prefill:
    # only its first request shows what prefill costs.
    first = target.first_ttft.get("long")
    b = warm if first is None or (warm is not None and warm >= first) else first
    if a is None or b is None or b < PREFILL_RATIO * a or b - a < PREFILL_MIN_MS:
        return None
    when = "(p50)" if b == warm else "the first time it is sent"
    return Finding(
        target.name,
        "prefill",
        "prompt length: prefill of long prompts dominates the time to first token",
        "first_token",
        f"the long prompt reaches its first token in {b:.0f} ms {when}, the minimal one in {a:.0f} ms (p50)",
        "shorten or reuse prompts (stable prefixes let prefix/prompt caching work: put the fixed part first); "
        "on vLLM enable prefix caching and chunked prefill; a smaller or faster model for long inputs",
        {"minimal_ttft_p50_ms": a, "long_ttft_p50_ms": warm, "long_first_ttft_ms": first, "difference_ms": b - a},
    )


def _prompt_cache(target: TargetSummary) -> Finding | None:
    long, first = _long_warm(target), target.first_ttft.get("long")
    repeat = None if long is None else long.p50("ttft_ms")
    if first is None or repeat is None or first < CACHE_RATIO * repeat or first - repeat < CACHE_MIN_MS:
        return None
    return Finding(
        target.name,
        "prompt_cache",
        "a prompt cache: a repeated prompt skips its prefill, a new one pays for it",
        "first_token",
        f"the long prompt reaches its first token in {first:.0f} ms the first time it is sent, in "
        f"{repeat:.0f} ms (p50) when repeated: {first / max(repeat, 0.001):.1f}x",
        "real traffic repeats prefixes, not whole prompts: put the fixed part (system prompt, tools, documents) "
        "first and keep it byte-identical; with several replicas route a conversation to the one that holds its "
        "prefix (in Sluice, routing: prefix); measure new prompts for the cost users actually see",
        {"first_ttft_ms": first, "repeat_ttft_p50_ms": repeat, "ratio": first / max(repeat, 0.001)},
    )


def _contention(target: TargetSummary) -> Finding | None:
    gaps = [gap for c in target.cells if c.stream for gap in c.gaps]
    if len(gaps) < JITTER_MIN_GAPS:
        return None
    p50, p90, worst = percentile(gaps, 0.5), percentile(gaps, 0.9), max(gaps)
    base = max(p50, TPOT_FLOOR_MS)
    spread = p90 >= JITTER_P90_RATIO * base and p90 - p50 >= JITTER_P90_MIN_MS
    stall = worst >= JITTER_MAX_RATIO * base and worst - p50 >= JITTER_MAX_MIN_MS
    if not (spread or stall):
        return None
    return Finding(
        target.name,
        "contention",
        "contention: token pacing is unstable, the server shares its capacity with other work",
        "stream",
        f"gaps between tokens: p50 {p50:.1f} ms, p90 {p90:.1f} ms, max {worst:.0f} ms over {len(gaps)} gaps",
        "check the server's batch size and concurrent requests (long prompts prefilled between decode steps "
        "stall every stream: chunked prefill helps), CPU or GPU shared with other jobs, garbage collection or "
        "a saturated event loop in proxies; spread load over more replicas",
        {"gaps": len(gaps), "gap_p50_ms": p50, "gap_p90_ms": p90, "gap_max_ms": worst},
    )


def _gateway_overhead(comparison: Comparison, via: TargetSummary) -> Finding | None:
    added, row = comparison.overhead(), comparison.headline()
    direct_ttft = None if row is None else row[0].p50("ttft_ms")
    if added is None or direct_ttft is None or added < GATEWAY_MIN_MS or added < GATEWAY_SHARE * direct_ttft:
        return None
    evidence: dict[str, Any] = {"added_ttft_ms": added, "direct_ttft_p50_ms": direct_ttft}
    elsewhere = (
        "the network hop to the gateway, its upstream connections (pooling, keep-alive, warm-up), or an "
        "overloaded gateway process"
    )
    advice = f"the gateway reports no timings of its own; check its logs or metrics, then {elsewhere}"
    view = via.gateway
    if view is not None:
        advice = f"the gateway's own stages do not explain it (see its server-timing): look at {elsewhere}"
        evidence |= {"gateway_overhead_p50_ms": view.overhead_ms, "outside_gateway_ms": view.outside_ms}
        stages = {k: v for k, v in view.entries.items() if k not in ("upstream", "overhead")}
        if view.overhead_ms is not None and view.overhead_ms >= added / 2 and stages:
            slowest = max(stages, key=lambda k: stages[k])
            evidence["slowest_stage"] = slowest
            advice = (
                f"the gateway's own overhead ({view.overhead_ms:.0f} ms) explains most of it; its slowest stage "
                f"is {slowest!r}: check that stage (auth cache misses, Redis round trips in rate_limit or cache)"
            )
    return Finding(
        "comparison",
        "gateway_overhead",
        "the gateway adds noticeable latency",
        "gateway",
        f"through the gateway the first token comes {added:.0f} ms later than direct ({direct_ttft:.0f} ms, p50)",
        advice,
        evidence,
    )
