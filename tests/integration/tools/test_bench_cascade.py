"""`sluice bench --scenario cascade` runs end to end at a small count and reports what it measured."""

from __future__ import annotations

import pytest

from tools.bench import cascade as bench_cascade


def test_the_cascade_scenario_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_cascade.main(20) == 0
    out = capsys.readouterr().out
    assert "Escalation rate" in out
    assert "Small-first path's added latency" in out
    assert "CPU per request through the pipeline" in out
