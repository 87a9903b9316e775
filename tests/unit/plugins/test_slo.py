"""The SLO state machine and the hedge budget, driven with explicit clocks."""

from __future__ import annotations

import pytest

from plugins.slo import DEGRADED, HEALTHY, HedgeBudget, ModelSlo, SloSettings, Window

SPEC = SloSettings(
    ttft_p95_ms=800,
    max_error_rate=0.2,
    window_s=10,
    min_samples=5,
    probe_ratio=0.2,
    cooldown_s=2,
    recovery_samples=3,
    recovery_margin=0.8,
)


def test_window_forgets_old_samples() -> None:
    window = Window(10)
    for i in range(20):
        window.add(float(i), float(i * 100), i % 4 == 0)
    count, p95, errors = window.stats(20.0)
    assert count == 10  # samples 10..19
    assert p95 == pytest.approx(1855.0)  # interpolated between 1800 and 1900
    assert errors == 0.2  # 12 and 16 failed


def test_degrades_on_latency_and_recovers_with_hysteresis() -> None:
    slo = ModelSlo("m", SPEC)
    for i in range(4):
        slo.record(i * 0.3, 2000, False)
    assert slo.state == HEALTHY  # too few samples to judge
    slo.record(1.5, 2000, False)
    assert slo.state == DEGRADED
    probes = [slo.is_probe() for _ in range(10)]
    assert probes.count(True) == 2  # exactly the probe ratio
    slo.record(2.0, 100, False)
    slo.record(2.1, 100, False)
    slo.record(2.2, 100, False)
    assert slo.state == DEGRADED  # good probes, but inside the cool-down
    slo.record(3.6, 700, False)  # under the SLO but not under it by the margin (640 ms)
    assert slo.state == DEGRADED
    for t in (3.7, 3.8, 3.9):
        slo.record(t, 100, False)
    assert slo.state == HEALTHY
    slo.record(4.0, 2000, False)  # one slow sample in a fresh window does not flap it back
    assert slo.state == HEALTHY


def test_degrades_on_errors() -> None:
    slo = ModelSlo("m", SPEC)
    for i in range(5):
        slo.record(i * 0.3, None, i < 2)
    assert slo.state == DEGRADED


def test_hedge_budget_caps_the_share() -> None:
    budget = HedgeBudget(0.25)
    grants = []
    for _ in range(8):
        granted = budget.grant(0.0)
        grants.append(granted)
        if granted:
            budget.settle(True)
    assert grants.count(True) == 2
    assert not HedgeBudget(0.0).grant(0.0)
