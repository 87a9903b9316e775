"""Fixtures of the tests against a real llama.cpp `llama-server` (skipped, saying why, where it cannot be built)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from tests.support.llamacpp import Start, build_or_skip, model_or_skip, start_servers
from tools.llamacpp import build as llamacpp
from tools.llamacpp.server import LlamaServer


@pytest.fixture(scope="session")
def llama_build() -> llamacpp.Build:
    return build_or_skip()


@pytest.fixture(scope="session")
def tiny_model(llama_build: llamacpp.Build) -> Path:
    return model_or_skip(llama_build)


@pytest.fixture()
def llama_servers(llama_build: llamacpp.Build, tiny_model: Path, tmp_path: Path) -> Iterator[Start]:
    """start(count, ready=True, start=True, model=tiny, slots=1, context=4096, threads=2, extra=()) -> servers,
    all stopped at the end of the test."""
    with ExitStack() as stack:

        def start(
            count: int = 1, ready: bool = True, start: bool = True, model: Path | None = None, **options: Any
        ) -> list[LlamaServer]:
            return start_servers(stack, llama_build, model or tiny_model, tmp_path, count, ready, start, **options)

        yield start
