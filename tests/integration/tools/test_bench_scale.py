"""The scenarios with processes of their own, in their smallest form: `workers` (one worker and two, the
requests counted in /metrics across workers) and `streams` (many concurrent streams through one worker).
Timings are not asserted: they belong to the full run; counts and completeness are."""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import replace

import pytest

from gateway.server.protocol import RESERVED_FDS
from tools.bench import command as bench
from tools.bench import scale as bench_scale
from tools.bench import streams as bench_streams
from tools.bench import workers as bench_workers
from tools.bench.fleet import run_loop

COMMAND = "sluice bench --smoke --scenario workers,streams"


@pytest.fixture(scope="module")
def report() -> bench_scale.ScaleReport:
    options = replace(bench.SMOKE, scenarios=bench_scale.OWN_PROCESSES, command=COMMAND)
    return run_loop(bench_scale.measure(options))


def test_workers_served_every_request_and_metrics_summed_them(report: bench_scale.ScaleReport) -> None:
    w = report.workers
    assert w is not None
    assert list(w.runs) == [bench_workers.ONE, bench_workers.TWO, bench_workers.PAIR]
    assert w.errors == 0
    for name, run in w.runs.items():
        assert run.answered == run.sent - bench_workers.CLIENTS  # each client's priming request is not timed
        assert run.counted == run.sent, f"{name}: /metrics counted {run.counted} of {run.sent}"
        assert run.cpu_s > 0
        assert math.isfinite(run.cpu_ms_per_request)
    assert w.runs[bench_workers.ONE].processes == 1
    assert w.runs[bench_workers.TWO].processes >= 3  # the supervisor and its two workers
    assert w.runs[bench_workers.PAIR].processes == 2
    assert math.isfinite(w.ratio)
    assert math.isfinite(w.over(bench_workers.ONE))


def test_the_page_judges_the_targets(report: bench_scale.ScaleReport) -> None:
    page = report.markdown()
    assert "## Workers: one process and two" in page
    assert {c.scenario for c in report.checks} == set(bench_scale.OWN_PROCESSES)


def test_own_process_scenarios_are_named_and_left_out_of_the_rig() -> None:
    assert bench.scenario_names("workers,core") == ("core", "workers")
    assert set(bench_scale.OWN_PROCESSES) <= set(bench.scenario_names("all"))


def test_streams_all_completed_through_one_worker(report: bench_scale.ScaleReport) -> None:
    s = report.streams
    assert s is not None
    assert s.errors == 0, s.failures
    assert s.completed == s.shape.streams == bench_streams.SHAPES["smoke"].streams
    assert s.expected_events == s.shape.tokens + 2  # as the upstream sends them: the tokens, a finish event, [DONE]
    assert len(s.ttft_ms) == len(s.connect_ms) == len(s.head_ms) == s.completed
    assert min(s.ttft_ms) >= s.shape.ttft_ms - 1.0  # the upstream's first-token delay (a millisecond timer) is a floor
    assert len(s.own_ms) == s.completed  # every response carried the gateway's own view
    assert 0 < s.idle_rss_mb <= s.peak_rss_mb
    assert s.gateway_cpu_s > 0
    assert math.isfinite(s.added(0.99))
    # The upstream stamped every first token: the gateway's part is what lies between its write and the read.
    assert len(s.transit_ms) == len(s.written_ms) == s.completed
    assert min(s.written_ms) >= s.shape.ttft_ms - 1.0
    assert all(0 < t <= ttft for t, ttft in zip(s.transit_ms, s.ttft_ms, strict=True))
    assert len(s.direct_transit_ms) == s.shape.streams // bench_streams.DIRECT_EVERY
    assert all(t > 0 for t in s.direct_transit_ms)
    assert s.fd_limit > 0
    assert s.peak_fds > 0  # sampled every second: how many were open then depends on the moment
    assert s.fd_errors == 0
    assert "## Streams: concurrency in one worker" in report.markdown()


def test_streams_run_at_what_the_descriptor_limit_carries() -> None:
    """Asked for more streams than a gateway limited to 1,024 descriptors can hold: as many as it can, all whole."""
    if shutil.which("prlimit") is None:
        pytest.skip("prlimit (util-linux) not found: it lowers the gateway's limit")
    shape = bench_streams.Shape(1000, 1.5, 200.0, 50.0, 10)
    s = run_loop(bench_streams.measure(bench.SMOKE, dict(os.environ), max_fds=1024, shape=shape))
    assert s.shape.streams == (1024 - RESERVED_FDS) // 2 < shape.streams
    assert s.fd_limit == 1024
    assert s.errors == 0, s.failures
    assert s.completed + s.refused == s.shape.streams
    assert s.completed == s.shape.streams  # sized to the cap, none had to be refused
    assert s.fd_errors == 0
