"""Fixtures of the core's integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture()
def fast_export(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spans exported every 20 ms, to the collector the test's config names and no other."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
