"""`sluice bench --scenario websocket` at its smallest: the fake OpenAI upstream, the gateway, both clients; no
timing asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.bench import websocket as bench_websocket


def test_the_websocket_scenario_runs_and_writes_its_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    written = tmp_path / "ws.md"
    assert bench_websocket.main("smoke", str(written)) == 0
    text = written.read_text()
    assert text == capsys.readouterr().out
    rows = [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows == [
        "side",
        "direct http",
        "direct websocket",
        "http",
        "websocket bridged",
        "websocket pinned",
        "20-turn loop",
        "http",
        "websocket bridged",
        "websocket pinned",
    ]
    # The pinned side's turns went over the one upstream socket its client socket got.
    assert "- Upstream, during the run: 1 socket(s) opened by the gateway" in text
