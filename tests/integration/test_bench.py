"""The benchmark's whole code path in its smallest form: real processes, every figure reported, and the
through-gateway requests really proxied. Timings are not asserted: they belong to the full run."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

import pytest

from gateway.tools import bench


@pytest.fixture(scope="module")
def report() -> bench.Report:
    return bench.run(replace(bench.SMOKE, pin=False, command="sluice bench --smoke"))


def positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def test_every_request_succeeded_and_went_where_it_should(report: bench.Report) -> None:
    assert report.errors == 0
    assert report.through_requests > 0
    # Each through-gateway answer carried the gateway's own header; no direct answer did.
    assert report.through_with_overhead == report.through_requests
    assert report.direct_with_overhead == 0


def test_latency_figures_are_complete(report: bench.Report) -> None:
    rates = list(bench.SMOKE.rates)
    for rows in (report.ttft, report.plain):
        assert [row.rate for row in rows] == rates
        for row in rows:
            for side in (row.direct, row.through, row.own):
                assert side.count > 0
                assert positive(side.p50) and positive(side.p99) and side.p50 <= side.p99
            # Overhead may come out negative in a tiny noisy sample, but it must be a number.
            assert math.isfinite(row.added_p50) and math.isfinite(row.added_p99)


def test_gap_and_throughput_figures_are_complete(report: bench.Report) -> None:
    for gap in report.gaps:
        assert gap.count > 0
        assert all(positive(v) for v in (gap.direct_mean, gap.through_mean, gap.direct_p99, gap.through_p99))
        assert math.isfinite(gap.added_mean) and math.isfinite(gap.added_p99)
    assert [row.mode for row in report.maxima] == ["non-stream", "stream"]
    for row in report.maxima:
        for value in (row.direct_rps, row.through_rps, row.gateway_cpu_percent, row.cpu_ms_per_request):
            assert positive(value)
        assert math.isfinite(row.core_busy_percent) and math.isfinite(row.harness_cpu_percent)
        assert row.limited_by
    assert positive(report.peak_rss_mb)
    assert math.isfinite(report.others_percent)
    assert min(report.tcp) >= 0


def test_targets_are_judged(report: bench.Report) -> None:
    figures = [check.figure for check in report.checks]
    assert len(figures) == 5
    assert any("@50 req/s" in f for f in figures) and any("@200 req/s" in f for f in figures)
    assert all(math.isfinite(check.value) for check in report.checks)


def test_markdown_has_every_section(report: bench.Report, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = report.markdown()
    for part in (
        "`sluice bench --smoke`",
        "- Machine: ",
        "## Targets",
        "## Summary",
        "## Streaming TTFT",
        "## Gaps between streamed token chunks",
        "## Non-streaming latency",
        "## Max throughput",
        "x-sluice-overhead-ms",
    ):
        assert part in text
    assert " nan" not in text and "n/a" not in text
    # main() prints the report and writes it where --write says.
    monkeypatch.setattr(bench, "run", lambda options: report)
    path = tmp_path / "report.md"
    assert bench.main(replace(bench.SMOKE, write=str(path))) == 0
    assert path.read_text() == text


def test_arguments_pick_a_preset() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    quick = bench.options_from_args(parser.parse_args(["--quick", "--no-pin", "--write", "out.md"]))
    assert quick.preset == "quick" and not quick.pin and quick.write == "out.md"
    full = bench.options_from_args(parser.parse_args(["--rounds", "5"]))
    assert full.preset == "default" and full.rounds == 5 and full.pin
