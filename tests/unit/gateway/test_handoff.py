"""The hand-off's readers in a process started without it, or with something that is not a pid: nothing armed."""

from __future__ import annotations

import pytest

from gateway import handoff
from gateway.server import lifeline
from gateway.telemetry import metric_files
from gateway.upstream import descriptors


def test_the_names_are_distinct_and_ours() -> None:
    names = [handoff.CONFIG, handoff.ACCESS_LOG, handoff.LISTEN, handoff.SUPERVISOR, handoff.METRICS_DIR]
    assert len(set(names)) == len(names)
    assert all(name.startswith("SLUICE_") for name in names)


@pytest.mark.parametrize("value", [None, "", "not-a-pid"])
def test_without_a_supervisor_pid_the_lifeline_arms_nothing(value: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if value is None:
        monkeypatch.delenv(handoff.SUPERVISOR, raising=False)
    else:
        monkeypatch.setenv(handoff.SUPERVISOR, value)
    assert lifeline.arm() is False


def test_the_metric_files_directory_comes_from_the_hand_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(handoff.METRICS_DIR, raising=False)
    assert metric_files.directory() is None
    monkeypatch.setenv(handoff.METRICS_DIR, "/tmp/sluice-metrics-x")
    assert metric_files.directory() == "/tmp/sluice-metrics-x"


def test_the_descriptor_limit_is_raised_to_the_hard_one_or_left() -> None:
    before, after = descriptors.raise_limit()
    assert after >= before
    assert descriptors.soft_limit() == after
