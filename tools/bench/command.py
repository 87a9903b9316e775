"""`sluice bench`: what the gateway adds to latency and what it costs, measured against the upstream it proxies.

Two simulated upstreams (`sluice sim`: `paced` streams 20 tokens 5 ms apart, `fast` answers at once) run pinned
to one CPU together with this load generator (and, for the scenarios that need them, a throwaway Redis and
OTLP sinks); the gateways (`sluice serve`, one worker each) run pinned to another. The same request bodies go
straight to an upstream ("direct") and through a gateway ("through"), the sides interleaved cell by cell and
their order rotated every round. The method is the one behind docs/benchmarks.md: open-loop arrivals at fixed
rates, overhead = through - direct within a round, median over rounds; max throughput from a closed loop;
gateway CPU read from /proc.

Scenarios (`--scenario NAME[,NAME...]`, `all` for every one): `core` (the bare gateway, the default),
`tenants` (auth + Redis rate limiter), `cache` (L1 and Redis hits, the cost of a miss), `tracing` (OTLP
export at two sample ratios), `full` (every stage on at once, every request a cache miss), and, with processes
of their own (bench_scale), `workers` (one worker against two) and `streams` (10,000 streams in one); `routing`
(the route policies over simulated replicas, bench_routing) and `instructions` (instructions per request under
callgrind, bench_instructions), `websocket` (the Responses API over WebSocket against HTTP, bench_websocket)
and `overload` (priority classes over overloaded simulated replicas, bench_overload) are not in `all`. This module
parses the command line
and runs them in order; the load is in bench_load, the processes in bench_fleet and bench_rig, each scenario
in its own module, the page in bench_report.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from tools.bench import cache as bench_cache
from tools.bench import core as bench_core
from tools.bench import full as bench_full
from tools.bench import scale as bench_scale
from tools.bench import tenants as bench_tenants
from tools.bench import tracing as bench_tracing
from tools.bench.fleet import BenchError, machine, placement, run_loop
from tools.bench.report import Report, command_line, judge
from tools.bench.rig import CORE_CONFIG, BenchOptions, Rig

__all__ = ["DEFAULT", "QUICK", "SMOKE", "BenchError", "BenchOptions", "Report", "add_arguments", "main", "run"]

T = TypeVar("T")
SCENARIOS = ("core", "tenants", "cache", "tracing", "full", *bench_scale.OWN_PROCESSES)
# Run by its own module with its own replicas and gateway (tools/bench/routing.py); not part of `all`.
ROUTING = "routing"
# Counted under callgrind by its own module (tools/bench/instructions.py); not part of `all`.
INSTRUCTIONS = "instructions"
# Against real llama.cpp servers (tools/bench/real.py, which needs the built llama-server); not part of `all`.
REAL = "real"
# The Responses API over WebSocket against HTTP, with its own simulated upstream and gateway
# (tools/bench/websocket.py); not part of `all`.
WEBSOCKET = "websocket"
# Priority classes under 2x overload of simulated replicas (tools/bench/overload.py); not part of `all`.
OVERLOAD = "overload"
# The small model first, on simulated models with a scripted failure mix (tools/bench/cascade.py); not in `all`.
CASCADE = "cascade"
EXTRA = (ROUTING, INSTRUCTIONS, REAL, WEBSOCKET, OVERLOAD, CASCADE)
NEEDS_REDIS = frozenset({"tenants", "cache", "full"})

DEFAULT = BenchOptions()
QUICK = replace(
    DEFAULT, rounds=1, cell_seconds=1.5, max_warmup_seconds=0.3, max_seconds=1.5, comparisons=2, preset="quick"
)
SMOKE = replace(
    DEFAULT,
    rounds=1,
    cell_seconds=0.25,
    min_requests=3,
    max_requests=50,
    concurrency=8,
    max_warmup_seconds=0.1,
    max_seconds=0.4,
    comparisons=1,
    pin=False,
    fill_prompts=300,
    preset="smoke",
)


def run(options: BenchOptions) -> Report:
    """Start the upstreams, helpers and gateways, run the scenarios, stop everything, and return the figures.

    The scenarios that start their own processes are left out: `main` runs them after this.
    """
    options = replace(options, scenarios=tuple(n for n in options.scenarios if n not in bench_scale.OWN_PROCESSES))
    started = time.perf_counter()
    where = placement(options.pin)
    names = options.scenarios
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    about = machine()
    sinks = (*(bench_tracing.SINKS if "tracing" in names else ()), *((bench_full.SINK,) if "full" in names else ()))
    affinity = os.sched_getaffinity(0)
    rig = Rig.launch(options, where, redis=bool(NEEDS_REDIS & set(names)), sinks=sinks)
    try:
        if where.harness_cpu is not None:
            os.sched_setaffinity(0, {where.harness_cpu})
        gc.collect()
        gc.freeze()  # start-up objects need no more collecting: keeps collector pauses out of the timings
        parts, rss = run_loop(measure(rig))
    finally:
        gc.unfreeze()
        os.sched_setaffinity(0, affinity)
        rig.stop()
    core, tenants, cache, tracing, full = parts
    return Report(
        options=options,
        date=date,
        machine=about,
        placement=where.note,
        seconds=time.perf_counter() - started,
        core=core,
        tenants=tenants,
        cache=cache,
        tracing=tracing,
        full=full,
        peak_rss_mb=rss,
        checks=judge(core, tenants, cache, full),
    )


Parts = tuple[
    bench_core.Core | None,
    bench_tenants.Tenants | None,
    bench_cache.Cache | None,
    bench_tracing.Tracing | None,
    bench_full.Full | None,
]


async def measure(rig: Rig) -> tuple[Parts, float]:
    """The scenarios in a fixed order, the core gateway running throughout as their common baseline."""
    names = rig.options.scenarios
    try:
        await rig.connect()
        await rig.start_gateways([bench_core.GATEWAY])
        core = await bench_core.measure(rig) if "core" in names else None
        tenants = await bench_tenants.measure(rig) if "tenants" in names else None
        cache = await bench_cache.measure(rig) if "cache" in names else None
        tracing = await bench_tracing.measure(rig) if "tracing" in names else None
        full = await bench_full.measure(rig) if "full" in names else None
        rss = rig.gateways[bench_core.NAME].child.peak_rss_mb()
    finally:
        await rig.aclose()
    return (core, tenants, cache, tracing, full), rss


def scenario_names(text: str) -> tuple[str, ...]:
    """`core`, `tenants,cache`, `all`: the scenarios to run, in the order they run."""
    asked = {name.strip() for name in text.split(",") if name.strip()}
    if "all" in asked:
        return SCENARIOS
    unknown = asked - {*SCENARIOS, *EXTRA}
    if unknown or not asked:
        names = ", ".join((*SCENARIOS, *EXTRA))
        raise argparse.ArgumentTypeError(
            f"unknown scenario {', '.join(sorted(unknown)) or '(none)'}: choose from {names} or all"
        )
    return tuple(name for name in (*SCENARIOS, *EXTRA) if name in asked)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="one short round (about 30 s for core)")
    parser.add_argument("--smoke", action="store_true", help="tiny counts, unpinned: checks that it all runs")
    parser.add_argument("--rounds", type=int, help="rounds of direct/through cells (default 3)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the processes to CPUs")
    parser.add_argument(
        "--scenario",
        type=scenario_names,
        default=("core",),
        metavar="NAME[,NAME...]",
        help=f"what to measure: {', '.join(SCENARIOS)}, or all (default core); {ROUTING}: the route policies; "
        f"{INSTRUCTIONS}: instructions per request under callgrind; {REAL}: routing and core against real llama.cpp "
        f"servers; {OVERLOAD}: priority classes over simulated replicas at 2x their capacity",
    )
    parser.add_argument("--config", help=f"the core gateway's config (default bench/{CORE_CONFIG})")
    parser.add_argument("--write", metavar="PATH", help="also write the markdown report to PATH")


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    base = SMOKE if args.smoke else QUICK if args.quick else DEFAULT
    return replace(
        base,
        rounds=args.rounds or base.rounds,
        pin=base.pin and not args.no_pin,
        scenarios=args.scenario,
        config=args.config,
        write=args.write,
        command=command_line(),
    )


def main(options: BenchOptions | argparse.Namespace) -> int:
    """Run, print the report, write it with --write; 0 when every request succeeded."""
    if isinstance(options, argparse.Namespace):
        options = options_from_args(options)
    if ROUTING in options.scenarios:
        from tools.bench import routing as bench_routing

        seconds = 4.0 if options.preset == "smoke" else 15.0 if options.preset == "quick" else 30.0
        status = bench_routing.main(seconds)
        options = replace(options, scenarios=tuple(name for name in options.scenarios if name != ROUTING))
        if not options.scenarios or status:
            return status
    if INSTRUCTIONS in options.scenarios:
        from tools.bench import instructions as bench_instructions

        status = bench_instructions.main(options.preset, options.command, options.write)
        options = replace(options, scenarios=tuple(name for name in options.scenarios if name != INSTRUCTIONS))
        if not options.scenarios or status:
            return status
    if OVERLOAD in options.scenarios:
        from tools.bench import overload as bench_overload

        seconds = 4.0 if options.preset == "smoke" else 15.0 if options.preset == "quick" else 30.0
        status = bench_overload.main(seconds, options.pin)
        options = replace(options, scenarios=tuple(name for name in options.scenarios if name != OVERLOAD))
        if not options.scenarios or status:
            return status
    if CASCADE in options.scenarios:
        from tools.bench import cascade as bench_cascade

        status = bench_cascade.main(50 if options.preset == "smoke" else 200 if options.preset == "quick" else 400)
        options = replace(options, scenarios=tuple(name for name in options.scenarios if name != CASCADE))
        if not options.scenarios or status:
            return status
    if REAL in options.scenarios:
        from tools.bench import real as bench_real

        seconds = 4.0 if options.preset == "smoke" else 15.0 if options.preset == "quick" else 30.0
        status = bench_real.main(seconds)
        options = replace(options, scenarios=tuple(name for name in options.scenarios if name != REAL))
        if not options.scenarios or status:
            return status

    if WEBSOCKET in options.scenarios:
        from tools.bench import websocket as bench_websocket

        status = bench_websocket.main(options.preset, options.write)
        options = replace(options, scenarios=tuple(name for name in options.scenarios if name != WEBSOCKET))
        if not options.scenarios or status:
            return status
    # The scenarios that start their own processes run after the rig's, which they would disturb.
    own = tuple(name for name in options.scenarios if name in bench_scale.OWN_PROCESSES)
    rigged = tuple(name for name in options.scenarios if name not in own)
    reports: list[Report | bench_scale.ScaleReport] = []
    try:
        if rigged:
            reports.append(run(options))
        if own:
            reports.append(run_loop(bench_scale.measure(replace(options, scenarios=own))))
    except BenchError as exc:
        print(f"sluice bench: {exc}", file=sys.stderr)
        return 2
    text = "\n".join(report.markdown() for report in reports)
    print(text, end="")
    if options.write:
        Path(options.write).write_text(text)
    return 0 if all(report.errors == 0 for report in reports) else 1


if __name__ == "__main__":
    cli = argparse.ArgumentParser(prog="sluice bench", description="Gateway overhead against a direct upstream.")
    add_arguments(cli)
    sys.exit(main(cli.parse_args()))
