"""Real llama.cpp `llama-server` processes for the tests: the binary built once and cached, a tiny model, N servers.

The binary comes from tools/llamacpp/build.py. Where nobody has built it yet, the first test that needs it builds it
(~6 min on 2 quiet cores, once per machine; the run says so as it starts, see `announcement`); where it cannot be
built (no compiler, the sdist unreachable) those tests skip, saying why; with $SLUICE_SKIP_LLAMACPP set they skip.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from tools.llamacpp import build as llamacpp
from tools.llamacpp.model import TINY, ModelSpec, ensure_model
from tools.llamacpp.server import LlamaServer

# start(count=1, ready=True, start=True, model=None, **LlamaServer options) -> the servers, stopped after the test
Start = Callable[..., list[LlamaServer]]


SKIP = "SLUICE_SKIP_LLAMACPP"  # set (to anything) and the tests against a real llama-server skip instead of building


def announcement() -> str | None:
    """One line for the start of a run that will build llama-server, else None."""
    if os.environ.get(SKIP):
        return f"llama-server: ${SKIP} is set, so the tests against a real llama-server skip"
    if llamacpp.cached() is not None or (llamacpp.home() / "failed.txt").is_file():
        return None
    return (
        "llama-server is not built yet: the first test that needs it downloads its pinned source (37 MB) and builds it"
        f" (about 6 min on 2 quiet cores, up to 30 under load; once per machine, cached in {llamacpp.home()});"
        f" set {SKIP}=1 to skip those tests instead"
    )


def build_or_skip() -> llamacpp.Build:
    if os.environ.get(SKIP):
        pytest.skip(f"${SKIP} is set")
    try:
        return llamacpp.locate()
    except llamacpp.Unavailable as missing:
        if (llamacpp.home() / "failed.txt").is_file():
            pytest.skip(str(missing))
    try:
        return llamacpp.ensure()
    except llamacpp.Unavailable as exc:
        pytest.skip(str(exc))


def model_or_skip(build: llamacpp.Build, spec: ModelSpec = TINY) -> Path:
    try:
        return ensure_model(spec, build.vocab)
    except ImportError as exc:  # the test extras were not installed
        pytest.skip(f"cannot write a GGUF model: {exc}")


def start_servers(
    stack: ExitStack,
    build: llamacpp.Build,
    model: Path,
    log_dir: Path,
    count: int = 1,
    ready: bool = True,
    start: bool = True,
    **options: Any,
) -> list[LlamaServer]:
    """`count` servers of `model`, started together (their loads overlap) and, with `ready`, waited for; with
    `start=False` only their ports are chosen, for the test to start them."""
    servers = [stack.enter_context(LlamaServer(build.binary, model, log_dir, **options)) for _ in range(count)]
    if not start:
        return servers
    for server in servers:
        server.start()
    if ready:
        for server in servers:
            server.wait_ready()
    return servers


def gateway_metric(url: str, name: str, **labels: str) -> float:
    """The sum of the gateway's `name` series whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5.0).text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def wait_for(condition: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.05)
