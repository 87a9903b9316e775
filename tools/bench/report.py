"""The report of a `sluice bench` run: every scenario's figures, the targets judged, and the markdown page.

The page opens with the command that made it and the targets table, then says how to read the figures,
then has one group of sections per scenario, the peers' figures (measured earlier, from bench/peers.md) and
the notes that qualify this run (failed requests, other processes' CPU share, TCP retransmissions).
"""

from __future__ import annotations

import contextlib
import math
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from tools.bench import cache as bench_cache
from tools.bench import core as bench_core
from tools.bench import full as bench_full
from tools.bench import tenants as bench_tenants
from tools.bench import tracing as bench_tracing
from tools.bench.cache import Cache
from tools.bench.core import Core
from tools.bench.figures import Check, targets
from tools.bench.fleet import BenchError, bench_file
from tools.bench.full import Full
from tools.bench.rig import BenchOptions, Phase
from tools.bench.tenants import Tenants
from tools.bench.tracing import Tracing

NOISY_PERCENT = 5.0
HOW_TO_READ = [
    "## How to read this",
    "",
    "- **Direct** is the floor: the same request sent straight to the simulated upstream, which answers at once, "
    "so what is left is the load generator and a loopback hop. **Through** adds a second hop (to another CPU) and "
    "the gateway. **Added** = through - direct: p50 is the median over rounds of the difference within a round "
    "(the two sides ran back to back); p99 is from all rounds' samples pooled.",
    "- **Own view** is the gateway's `x-sluice-overhead-ms`: its perf_counter time from arrival to the response "
    "head, minus the upstream wait. No hops and no client in it: the floor of what a request can cost.",
    "- **A gateway against another** (`auth - core`, `cache - auth`): the same slot of a cell sends one request "
    "to each, a moment apart; the difference is per request, median over every pair, with the range of the "
    "cells' medians. Tracing against off: the difference of p50s cell by cell. Microsecond figures are "
    "differences of latencies near half a millisecond: read them with their range, beside the own view and "
    "`server-timing` (each stage's own duration).",
    "- **p99** on a small VM is mostly CPU wake-ups and cross-CPU hops: compare p50s across runs, p99s only "
    "within one run.",
    "- **Max throughput** is a lower bound unless *limited by* says the gateway's CPU was saturated.",
    "- **Cold and hot.** At 200 req/s a CPU idles for milliseconds between requests, and on a VM the first "
    "instructions after such a pause run many times slower than in a busy loop (caches and predictors are cold). "
    "Stage durations at fixed rates (`server-timing`, the own view) are cold figures; CPU time per request at max "
    "throughput is the hot cost of the same code.",
    "- **Scenario cells take turns.** The tenants and cache cells send to all their targets on one schedule, one "
    "request each per slot in an order that changes from slot to slot, each target at the stated rate, so that "
    "comparisons between targets share the machine's state. "
    "Their CPUs idle less than in the core's one-target cells, so compare their absolute figures within a table, "
    "not with the core's.",
]


@dataclass(frozen=True, slots=True)
class Report:
    options: BenchOptions
    date: str
    machine: str
    placement: str
    seconds: float
    core: Core | None
    tenants: Tenants | None
    cache: Cache | None
    tracing: Tracing | None
    full: Full | None
    peak_rss_mb: float  # the core gateway's, at the end
    checks: list[Check]

    @property
    def errors(self) -> int:
        return sum(part.errors for part in self.parts if part is not None)

    @property
    def phases(self) -> list[Phase]:
        return [part.phase for part in self.parts if part is not None]

    @property
    def parts(self) -> tuple[Core | Tenants | Cache | Tracing | Full | None, ...]:
        return (self.core, self.tenants, self.cache, self.tracing, self.full)

    def markdown(self) -> str:
        return render(self)


def judge(core: Core | None, tenants: Tenants | None, cache: Cache | None, full: Full | None = None) -> list[Check]:
    """Every target of the scenarios that ran (tracing has none: its figures are for comparison)."""
    found: list[Check] = []
    if core is not None:
        found += bench_core.checks(core)
    if tenants is not None:
        found += bench_tenants.checks(tenants)
    if cache is not None:
        found += bench_cache.checks(cache)
    if full is not None:
        found += bench_full.checks(full)
    return found


def render(report: Report) -> str:
    o = report.options
    lines = [
        "# Sluice benchmark",
        "",
        f"- Command: `{o.command or command_line()}`",
        f"- Date: {report.date}; the run took {report.seconds:.0f} s",
        f"- Machine: {report.machine}",
        f"- Placement: {report.placement}",
        f"- Scenarios: {', '.join(o.scenarios)}",
        f"- Method: {method(o)}",
        "",
        *targets(report.checks),
        *HOW_TO_READ,
        "",
        *sections(report),
        *peers(),
        "## Notes",
        "",
        *notes(report),
    ]
    return "\n".join(lines) + "\n"


def method(o: BenchOptions) -> str:
    counts = ", ".join(f"{max(o.min_requests, min(o.max_requests, round(r * o.cell_seconds)))} @{r:g}" for r in o.rates)
    return (
        f"{o.rounds} round(s), direct and through interleaved, the order of the sides rotated every round; "
        f"open-loop arrivals evenly spaced; requests per cell and side: {counts}; upstream `paced` streams "
        f"{o.tokens} tokens {o.tpot_ms:g} ms apart (TTFT = first SSE event carrying a token), `fast` answers at once "
        f"({o.plain_tokens}-token replies); closed loops use {o.concurrency} connections for {o.max_seconds:g} s "
        f"per round after {o.max_warmup_seconds:g} s of warm-up. Times in ms unless marked µs."
    )


def sections(report: Report) -> list[str]:
    found: list[str] = []
    if report.core is not None:
        found += [*bench_core.render(report.core, report.options, report.peak_rss_mb), ""]
    if report.tenants is not None:
        found += [*bench_tenants.render(report.tenants), ""]
    if report.cache is not None:
        found += [*bench_cache.render(report.cache), ""]
    if report.tracing is not None:
        found += [*bench_tracing.render(report.tracing), ""]
    if report.full is not None:
        found += [*bench_full.render(report.full), ""]
    return found


def peers() -> list[str]:
    """Figures measured apart from the run (bench/peers.md, bench/redis_client.md), when the source tree is at hand."""
    found: list[str] = []
    for name in ("peers.md", "redis_client.md"):
        with contextlib.suppress(BenchError, OSError):
            found += [bench_file(name).read_text().strip(), ""]
    return found


def notes(report: Report) -> list[str]:
    found = [f"- Failed requests: {report.errors}."]
    if report.core is not None:
        found += bench_core.notes(report.core)
    if report.tenants is not None:
        found += bench_tenants.notes(report.tenants)
    if report.cache is not None:
        found += bench_cache.notes(report.cache)
    if report.tracing is not None:
        found += bench_tracing.notes(report.tracing)
    if report.full is not None:
        found += bench_full.notes(report.full)
    shares = ", ".join(f"{p.name} {p.others_percent:.1f} %" for p in report.phases)
    found.append(
        f"- Other processes' share of the machine's CPU time during each scenario: {shares}"
        + (" (above 5 %: the figures are noisy, re-run on a quiet machine)." if noisy(report) else ".")
    )
    took = ", ".join(f"{p.name} {p.seconds:.0f} s" for p in report.phases)
    tcp = ", ".join(f"{p.name} {p.tcp[0]} / {p.tcp[1]}" for p in report.phases)
    found += [
        f"- Measuring time per scenario (start-up excluded): {took}.",
        f"- TCP on the whole machine, segments retransmitted / retransmission timeouts: {tcp} (a timeout stalls "
        "a connection for 200 ms or more: it shows in p99).",
        "- The gateway's own view counts its time up to the response head; the outside view adds the network hops "
        "and the relay of the first token.",
    ]
    if not report.placement.startswith("gateways on CPU"):
        found.append("- Processes were not pinned: the gateways, upstreams and load generator compete for CPUs.")
    return found


def noisy(report: Report) -> bool:
    return any(p.others_percent >= NOISY_PERCENT for p in report.phases if not math.isnan(p.others_percent))


def command_line() -> str:
    argv = sys.argv
    if Path(argv[0]).name == "sluice" or argv[0].endswith("gateway/cli.py"):  # the script, or python -m gateway.cli
        return shlex.join(["sluice", *argv[1:]])
    if argv[0].endswith("bench.py"):
        return shlex.join(["python", "-m", "tools.bench", *argv[1:]])
    return shlex.join(argv)
