"""The `full` scenario: every stage on at once (auth, Redis rate limiter, cache misses, SLO, tracing at 0.1).

One more gateway (`scenarios/full.yaml`) beside the core one and the direct upstream, all sent the same
prompts, never seen before, so that every request through the full gateway is a cache miss: it looks up L1
(and asks its presence filter, which knows Redis cannot hold the key, so no Redis lookup), goes upstream, and
stores its answer, announcing the key. Per round: streaming TTFT at 50 and 200 req/s (open loop,
the three sides in turn), then max non-streaming throughput of core and full (closed loop) with the
gateway's CPU per request. At the end, `fill_prompts` more unique prompts go through the full gateway and
its peak RSS is read: the cache's L1 must keep it bounded however many answers it has stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tools.bench.core import GATEWAY as CORE
from tools.bench.core import NAME as CORE_NAME
from tools.bench.figures import SATURATED_PERCENT, Check, MaxRow, Row, check, latency_row, max_row, ms, named
from tools.bench.load import Run, Samples, send_all, unique_workload
from tools.bench.rig import Cells, GatewaySpec, Phase, Rig, add, rotated

NAME = "full"
CONFIG = "scenarios/full.yaml"
SINK = "otlp sink full"
RATES = (50.0, 200.0)
STAGES = ("auth", "rate_limit", "cache", "slo")
# Bodies per closed-loop run: more than a gateway can answer in its warm-up and window, so none repeats.
CLOSED_LOOP_RPS_BOUND = 10_000
TARGET_RPS = 3500.0
TARGET_SHARE = 0.7  # of the bare gateway's max in the same run
TARGET_TTFT_MS = 0.75
TARGET_P99_OVER_BARE_MS = 1.0
TARGET_CPU_MS = 0.3
TARGET_RSS_MB = 100.0


@dataclass(frozen=True, slots=True)
class Full:
    ttft: dict[tuple[str, float], Row]  # (gateway, rate) -> vs direct
    maxima: dict[str, MaxRow]  # gateway -> non-stream closed loop
    filled: int  # unique prompts sent in the fill
    fill_misses: int  # of which answered `x-sluice-cache: miss`
    misses: int  # responses of the full gateway marked as misses during the cells
    responses: int  # responses of the full gateway during the cells
    stages: dict[str, int]  # of those, how many named each plugin's stage in `server-timing`
    spans: int  # received by its OTLP sink
    rss_mb: float  # the full gateway's peak RSS, after the fill
    errors: int
    phase: Phase

    @property
    def share(self) -> float:
        core = self.maxima[CORE_NAME].through_rps
        return self.maxima[NAME].through_rps / core if core else math.nan

    @property
    def p99_over_bare(self) -> float:
        top = RATES[-1]
        return self.ttft[(NAME, top)].through.p99 - self.ttft[(CORE_NAME, top)].through.p99


def spec(sink_url: str) -> GatewaySpec:
    return GatewaySpec(NAME, CONFIG, (("BENCH_OTLP_ENDPOINT", sink_url),))


async def measure(rig: Rig) -> Full:
    o = rig.options
    cells: Cells = {}
    runs: dict[str, list[Run]] = {}
    headers = rig.auth_headers
    async with rig.phase(NAME, [spec(rig.url(SINK))]) as phase:
        names = [CORE.name, NAME]
        for number in range(o.rounds):
            sides = rotated([rig.direct(), *(rig.through(name) for name in names)], number)
            for rate in RATES:
                for side in sides:
                    work = unique_workload("paced", True, o.tokens, rig.count(rate), headers)
                    warm = unique_workload("paced", True, o.tokens, o.concurrency, headers)
                    add(cells, "ttft", rate, side.name, await rig.open_loop(side.paced, work, rate, warm))
            bodies = math.ceil((o.max_warmup_seconds + o.max_seconds) * CLOSED_LOOP_RPS_BOUND)
            for name in rotated(names, number):
                work = unique_workload("fast", False, o.plain_tokens, bodies, headers)
                runs.setdefault(name, []).append(await rig.closed_loop(rig.through(name).fast, work, rig.meters(name)))
        fill = unique_workload("fast", False, o.plain_tokens, o.fill_prompts, headers)
        filled = await send_all(rig.through(NAME).fast, fill, o.concurrency)
        rss = rig.gateways[NAME].child.peak_rss_mb()
    spans = await rig.sink_spans(SINK)  # the gateway has stopped, so it has flushed its spans
    ttft = {
        (name, rate): latency_row(rate, cells[("ttft", rate, "direct")], cells[("ttft", rate, name)])
        for name in names
        for rate in RATES
    }
    mine = [s for (_, _, n), rounds in cells.items() if n == NAME for s in rounds] + [r.samples for r in runs[NAME]]
    every: list[Samples] = [s for rounds in cells.values() for s in rounds]
    every += [r.samples for done in runs.values() for r in done] + [filled]
    return Full(
        ttft=ttft,
        maxima={name: max_row("non-stream", [], runs[name]) for name in names},
        filled=len(fill.bodies),
        fill_misses=filled.cache.get(b"miss", 0),
        misses=sum(s.cache.get(b"miss", 0) for s in mine),
        responses=sum(len(s.latency) for s in mine),
        stages={stage: sum(named(s.timing, stage) for s in mine) for stage in STAGES},
        rss_mb=rss,
        spans=spans,
        errors=sum(s.errors for s in every),
        phase=phase,
    )


def checks(f: Full) -> list[Check]:
    found = [
        check(NAME, f"stream TTFT added, p50 @{rate:g} req/s", f.ttft[(NAME, rate)].added_p50, TARGET_TTFT_MS, "ms")
        for rate in RATES
    ]
    full = f.maxima[NAME]
    return [
        *found,
        check(
            NAME,
            f"stream TTFT p99 @{RATES[-1]:g} req/s, above the bare gateway's",
            f.p99_over_bare,
            TARGET_P99_OVER_BARE_MS,
            "ms",
        ),
        check(NAME, "max non-stream req/s, one worker", full.through_rps, TARGET_RPS, "req/s", at_least=True),
        check(NAME, "max non-stream req/s, share of the bare gateway's", f.share * 100, TARGET_SHARE * 100, "%", True),
        check(NAME, "gateway CPU per non-stream request at max", full.cpu_ms_per_request, TARGET_CPU_MS, "ms"),
        check(NAME, f"peak RSS after {f.filled:,} unique cached prompts", f.rss_mb, TARGET_RSS_MB, "MB"),
    ]


def render(f: Full) -> list[str]:
    rates = " / ".join(f"{r:g}" for r in RATES)
    top = RATES[-1]
    lines = [
        "## Full: every stage on",
        "",
        "`full.yaml`: auth (key in the config), rate_limit (buckets in Redis), cache `mode: always` on prompts never "
        "sent before (every request a miss: an L1 lookup, a presence filter that skips the Redis one, then a "
        "store), an SLO on every model, traces sampled at 0.1 to an OTLP sink; beside the bare gateway (no "
        "plugins) and the direct upstream, all sent the same prompts. TTFT from open loops; max throughput from a "
        "closed loop of non-streaming requests.",
        "",
        f"| gateway | stream TTFT added p50 @{rates} req/s | TTFT p99 @{top:g}: direct / through / added "
        "| own view p50 @200 | max non-stream req/s | gateway CPU % | CPU ms per request | limited by |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in (CORE_NAME, NAME):
        row, m = f.ttft[(name, top)], f.maxima[name]
        added = " / ".join(ms(f.ttft[(name, rate)].added_p50) for rate in RATES)
        lines.append(
            f"| {name} | {added} | {ms(row.direct.p99)} / {ms(row.through.p99)} / {ms(row.added_p99)} "
            f"| {ms(row.own.p50, 3)} | {m.through_rps:,.0f} | {m.gateway_cpu_percent:.0f} "
            f"| {ms(m.cpu_ms_per_request, 3)} | {m.limited_by} |"
        )
    lines += [
        "",
        f"- Max non-stream with every stage on: {f.share * 100:.0f} % of the bare gateway's; TTFT p99 "
        f"@{top:g} req/s {f.p99_over_bare:+.2f} ms against it.",
        f"- Cache misses: {f.misses:,} of the full gateway's {f.responses:,} answers in the cells; then "
        f"{f.fill_misses:,} of {f.filled:,} unique prompts in the fill; peak RSS after it {f.rss_mb:.0f} MB "
        "(the default L1 bounds: 10,000 entries, 64 MiB).",
        f"- Spans received by the sink: {f.spans:,}.",
    ]
    return lines


def notes(f: Full) -> list[str]:
    m = f.maxima[NAME]
    if m.gateway_cpu_percent >= SATURATED_PERCENT:
        return []
    return [
        f"- Full: the gateway used {m.gateway_cpu_percent:.0f} % of a CPU at max ({m.limited_by}): "
        f"{m.through_rps:,.0f} req/s is a lower bound."
    ]
