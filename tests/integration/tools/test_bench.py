"""The benchmark's whole code path in its smallest form: every scenario with real processes (upstreams,
gateways, redis-server, OTLP sinks), every figure reported, and the through-gateway requests really served by
the plugins each scenario is about. Timings are not asserted: they belong to the full run."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

import pytest

from tools.bench import command as bench
from tools.bench import scale as bench_scale
from tools.bench.figures import Difference, Dist, Row

COMMAND = "sluice bench --smoke --scenario all"


@pytest.fixture(scope="module")
def report() -> bench.Report:
    return bench.run(replace(bench.SMOKE, scenarios=bench.SCENARIOS, command=COMMAND))


def positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def complete(dist: Dist) -> bool:
    return dist.count > 0 and positive(dist.p50) and positive(dist.p99) and dist.p50 <= dist.p99


def complete_row(row: Row) -> bool:
    # Overhead may come out negative in a tiny noisy sample, but it must be a number.
    sides = all(complete(side) for side in (row.direct, row.through, row.own))
    return sides and math.isfinite(row.added_p50) and math.isfinite(row.added_p99)


def measured(difference: Difference) -> bool:
    return difference.pairs > 0 and all(math.isfinite(v) for v in (difference.median, difference.low, difference.high))


def test_every_request_succeeded_and_went_where_it_should(report: bench.Report) -> None:
    assert report.errors == 0
    core = report.core
    assert core is not None
    assert core.through_requests > 0
    # Each through-gateway answer carried the gateway's own header; no direct answer did.
    assert core.through_with_overhead == core.through_requests
    assert core.direct_with_overhead == 0


def test_core_figures_are_complete(report: bench.Report) -> None:
    core = report.core
    assert core is not None
    for rows in (core.ttft, core.plain):
        assert [row.rate for row in rows] == list(bench.SMOKE.rates)
        assert all(complete_row(row) for row in rows)
    for gap in core.gaps:
        assert gap.count > 0
        assert all(positive(v) for v in (gap.direct_mean, gap.through_mean, gap.direct_p99, gap.through_p99))
        assert math.isfinite(gap.added_mean)
        assert math.isfinite(gap.added_p99)
    assert [row.mode for row in core.maxima] == [row.mode for row in core.floor] == ["non-stream", "stream"]
    for row in (*core.maxima, *core.floor):
        for value in (row.direct_rps, row.through_rps, row.gateway_cpu_percent, row.cpu_ms_per_request):
            assert positive(value)
        assert math.isfinite(row.core_busy_percent)
        assert math.isfinite(row.harness_cpu_percent)
        assert row.limited_by
    assert positive(report.peak_rss_mb)


def test_tenants_went_through_auth_and_the_redis_limiter(report: bench.Report) -> None:
    t = report.tenants
    assert t is not None
    assert {key[0] for key in t.rows} == {"core", "auth", "tenants"}
    assert all(complete_row(row) for row in t.rows.values())
    assert all(measured(d) for d in (t.auth_cost, t.auth_own, t.limiter_cost, t.limiter_own))
    assert complete(t.auth_stage)
    assert complete(t.limiter_stage)
    assert set(t.maxima) == {"core", "auth", "tenants"}
    assert all(positive(m.through_rps) and positive(m.cpu_ms_per_request) for m in t.maxima.values())
    assert set(t.hot_stages) == {"auth", "rate_limit"}
    assert all(complete(d) for d in t.hot_stages.values())
    # Every response of each gateway named the stages its plugins ran, and Redis never failed.
    assert t.requests["auth"] > 0
    assert t.named[("auth", "auth")] == t.requests["auth"]
    assert t.named[("auth", "rate_limit")] == 0
    assert t.named[("tenants", "auth")] == t.named[("tenants", "rate_limit")] == t.requests["tenants"] > 0
    assert t.redis_failures == 0


def test_cache_hits_came_from_l1_and_redis_and_misses_went_upstream(report: bench.Report) -> None:
    c = report.cache
    assert c is not None
    assert [(h.layer, h.kind) for h in c.hits] == [
        ("L1", "stream"),
        ("L1", "non-stream"),
        ("Redis", "stream"),
        ("Redis", "non-stream"),
    ]
    for hit in c.hits:
        assert complete_row(hit.row)
        assert complete(hit.stage)
        assert hit.hits == hit.requests > 0  # every answer said `x-sluice-cache: hit`
    for miss in c.misses:
        assert all(complete(d) for d in (miss.core, miss.auth, miss.cache, miss.stage))
        assert measured(miss.vs_core)
        assert measured(miss.vs_auth)
        assert miss.misses == miss.requests > 0
    assert complete(c.floor)
    assert c.redis_failures == 0


def test_tracing_exported_spans_at_each_ratio(report: bench.Report) -> None:
    t = report.tracing
    assert t is not None
    off, full, tenth = t.variants
    assert (off.ratio, full.ratio, tenth.ratio) == ("off", "1.0", "0.1")
    for v in t.variants:
        assert complete_row(v.ttft)
        assert positive(v.maximum.through_rps)
        assert positive(v.maximum.cpu_ms_per_request)
        assert v.served > 0
    assert all(measured(d) for d in (full.vs_off, tenth.vs_off, full.own_vs_off, tenth.own_vs_off))
    # Every request of the 1.0 gateway reached its sink as several spans; a tenth of them at 0.1.
    assert full.spans >= 3 * full.served
    assert full.dropped == 0
    assert 0 < tenth.spans / tenth.served < full.spans / full.served


def test_full_ran_every_stage_and_every_request_missed(report: bench.Report) -> None:
    f = report.full
    assert f is not None
    assert set(f.ttft) == {(name, rate) for name in ("core", "full") for rate in (50.0, 200.0)}
    assert all(complete_row(row) for row in f.ttft.values())
    assert set(f.maxima) == {"core", "full"}
    assert all(positive(m.through_rps) and positive(m.cpu_ms_per_request) for m in f.maxima.values())
    assert positive(f.share)
    assert math.isfinite(f.p99_over_bare)
    # Unique prompts: every answer of the full gateway was a cache miss, in the cells and in the fill.
    assert f.misses == f.responses > 0
    assert f.stages == dict.fromkeys(("auth", "rate_limit", "cache", "slo"), f.responses)
    assert f.fill_misses == f.filled == bench.SMOKE.fill_prompts
    assert positive(f.rss_mb)
    assert f.spans > 0


def test_targets_are_judged(report: bench.Report) -> None:
    scenarios = [check.scenario for check in report.checks]
    assert scenarios == ["core"] * 6 + ["tenants"] + ["cache"] * 4 + ["full"] * 7
    figures = [check.figure for check in report.checks]
    assert any("@50 req/s" in f for f in figures)
    assert any("@200 req/s" in f for f in figures)
    assert all(math.isfinite(check.value) for check in report.checks)
    rigged = [name for name in bench.SCENARIOS if name not in bench_scale.OWN_PROCESSES]  # those run by main
    assert [p.name for p in report.phases] == rigged
    assert all(math.isfinite(p.others_percent) and min(p.tcp) >= 0 for p in report.phases)


def test_markdown_has_every_section(report: bench.Report, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = report.markdown()
    assert text.startswith("# Sluice benchmark\n\n- Command: `" + COMMAND + "`")
    for part in (
        "- Machine: ",
        "## Targets",
        "## How to read this",
        "## Core: summary",
        "## Core: streaming TTFT",
        "## Core: gaps between streamed token chunks",
        "## Core: non-streaming latency",
        "## Core: max throughput",
        "## Tenants: auth + Redis rate limiter",
        "## Cache: hits end to end",
        "## Cache: what it adds to a miss",
        "## Tracing: OTLP export on vs off",
        "## Full: every stage on",
        "## Peers, for comparison: measured earlier, not in this run",
        "x-sluice-overhead-ms",
    ):
        assert part in text
    assert " nan" not in text
    assert "n/a" not in text
    # main() prints the report and writes it where --write says.
    monkeypatch.setattr(bench, "run", lambda options: report)
    path = tmp_path / "report.md"
    assert bench.main(replace(bench.SMOKE, write=str(path))) == 0
    assert path.read_text() == text


def test_arguments_pick_a_preset_and_scenarios() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    quick = bench.options_from_args(parser.parse_args(["--quick", "--no-pin", "--write", "out.md"]))
    assert quick.preset == "quick"
    assert not quick.pin
    assert quick.write == "out.md"
    assert quick.scenarios == ("core",)
    full = bench.options_from_args(parser.parse_args(["--rounds", "5", "--scenario", "tracing,tenants"]))
    assert full.preset == "default"
    assert full.rounds == 5
    assert full.pin
    assert full.scenarios == ("tenants", "tracing")  # always run in the same order
    assert bench.options_from_args(parser.parse_args(["--scenario", "all"])).scenarios == bench.SCENARIOS
    with pytest.raises(SystemExit):
        parser.parse_args(["--scenario", "core,nope"])
