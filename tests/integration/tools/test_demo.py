"""`sluice demo` end to end, shortened: its output must show the SLO degrading and recovering, the fallback
serving while the primary is slow, and cache hits. The demo runs the real gateway, the slo and cache plugins
and simulated upstreams, so a broken SLO or cache shows up here as a missing line or a zero count."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from dataclasses import dataclass

import pytest

from tools import demo

DURATION_S = 16.0  # the shortest run with room for detection, the cool-down and the recovery probes
ROW = re.compile(
    r"^\s*(?P<time>\d+)s\s+[\d.]+\s+(?:-|\d+ ms)\s+(?:-|\d+ ms)\s+(?P<large>\d+)\s+(?P<small>\d+)\s+"
    r"(?P<fallback>.+?)\s+(?P<cached>\d+)\s+(?:-|[\d.]+ ms)\s+(?P<state>healthy|degraded)"
)
STORY = re.compile(r"degraded at t=(?P<degraded>[\d.]+)s .* recovered at t=(?P<recovered>[\d.]+)s")


@dataclass(frozen=True, slots=True)
class Row:
    phase: str
    time: int
    large: int
    small: int
    fallback: str
    cached: int
    state: str


@dataclass(frozen=True, slots=True)
class Output:
    code: int
    text: str
    phases: list[tuple[str, float]]  # (name, announced at)
    rows: list[Row]


@pytest.fixture(scope="module")
def output() -> Output:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = demo.main(parser.parse_args(["--duration", str(DURATION_S)]))
    return parse(code, out.getvalue())


def parse(code: int, text: str) -> Output:
    phases: list[tuple[str, float]] = []
    rows: list[Row] = []
    names = [phase.name for phase in demo.PHASES]
    for line in text.splitlines():
        announced = re.match(r"^==>\s+([\d.]+)s\s+(.+?):", line)
        if announced and announced.group(2) in names:
            phases.append((announced.group(2), float(announced.group(1))))
            continue
        found = ROW.match(line)
        if found and phases:
            rows.append(
                Row(
                    phase=phases[-1][0],
                    time=int(found["time"]),
                    large=int(found["large"]),
                    small=int(found["small"]),
                    fallback=found["fallback"],
                    cached=int(found["cached"]),
                    state=found["state"],
                )
            )
    return Output(code, text, phases, rows)


def test_the_phases_are_announced_in_order(output: Output) -> None:
    assert [name for name, _ in output.phases] == ["warm", "large overloaded", "large recovered"], output.text
    assert output.code == 0, output.text
    assert "failed requests: 0" in output.text


def test_the_slo_degrades_then_recovers(output: Output) -> None:
    states = [row.state for row in output.rows]
    assert "degraded" in states, output.text
    first = states.index("degraded")
    assert "healthy" in states[first + 1 :], output.text
    # Degraded only because of the overload: every line of the warm phase is healthy and served by chat-large.
    warm = [row for row in output.rows if row.phase == "warm"]
    assert warm, output.text
    assert all(row.state == "healthy" and row.small == 0 for row in warm), output.text
    assert sum(row.large for row in warm) > 0


def test_the_fallback_serves_while_the_primary_is_overloaded(output: Output) -> None:
    overloaded = [row for row in output.rows if row.phase == "large overloaded"]
    assert sum(row.small for row in overloaded) > 0, output.text
    assert any(row.fallback.startswith("slo") for row in overloaded), output.text
    # Once healthy again, chat-large serves and nothing falls back.
    last = output.rows[-1]
    assert last.state == "healthy", output.text
    assert last.large > 0, output.text
    assert last.small == 0, output.text
    assert last.fallback == "-", output.text


def test_the_cache_answers_the_repeated_prompts(output: Output) -> None:
    assert sum(row.cached for row in output.rows) > 0, output.text
    hits = re.search(r"cache: (\d+) hits of (\d+) requests", output.text)
    assert hits is not None, output.text
    assert 0.15 < int(hits.group(1)) / int(hits.group(2)) < 0.3, output.text


def test_the_summary_gives_degradation_and_recovery_times(output: Output) -> None:
    story = STORY.search(output.text)
    assert story is not None, output.text
    overload_at = dict(output.phases)["large overloaded"]
    recover_at = dict(output.phases)["large recovered"]
    degraded, recovered = float(story["degraded"]), float(story["recovered"])
    assert overload_at < degraded < recover_at < recovered <= DURATION_S + 1, output.text
