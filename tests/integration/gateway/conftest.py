"""Fixtures of the core's integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import compiled


@pytest.fixture()
def fast_export(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spans exported every 20 ms, to the collector the test's config names and no other."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def compiled_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of this checkout with the request path's compiled extensions in place (tests/support/compiled.py):
    built once per set of sources and cached; the test skips, saying why, where it cannot be built."""
    try:
        build = compiled.ensure()
    except compiled.Unavailable as exc:
        pytest.skip(str(exc))
    if build.seconds:
        print(f"compiled the request path in {build.seconds:.0f} s ({build.where})")
    return compiled.tree(build, tmp_path_factory.mktemp("compiled") / "tree")
