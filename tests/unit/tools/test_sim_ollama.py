"""Ollama's keep_alive values, as the stand-in reads them: seconds as a number, else a Go duration string.

A string number ("10", "-1") has no unit, which Go's time.ParseDuration refuses, so Ollama does too.
"""

from __future__ import annotations

from typing import Any

import pytest

from tools.sim.ollama import keep_alive


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(None, 300.0), (0, 0.0), ("0", 0.0), (30, 30.0), (1.5, 1.5), ("10m", 600.0), ("1h30m", 5400.0),
     ("500ms", 0.5), (-1, -1.0), ("-5m", -300.0), ("2.5s", 2.5)],
)  # fmt: skip
def test_keep_alive_is_seconds_or_a_go_duration(value: Any, seconds: float) -> None:
    assert keep_alive(value, 300.0) == seconds


@pytest.mark.parametrize("value", ["soon", "10", "-1", "5 m", "", "m", True, [1]])
def test_keep_alive_refuses_what_ollama_refuses(value: Any) -> None:
    with pytest.raises(ValueError, match=r"^(Unsupported type|time: )"):
        keep_alive(value, 300.0)
