"""`sluice serve` raises its soft file-descriptor limit to the hard one before it binds, and says so."""

from __future__ import annotations

import resource
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.gateway import gateway_process

SIM = "backends: {s: {type: simulated, ttft_ms: 5, tpot_ms: 1, tokens: 4}}\nmodels: {m: {backend: s}}\n"
LOW = 256


def limits(pid: int) -> tuple[int, int]:
    """(soft, hard) `Max open files` of a running process, as the kernel reports them."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError(f"no open-files line in /proc/{pid}/limits")


@pytest.fixture()
def low_soft_limit() -> Iterator[int]:
    """This process's soft limit lowered (children inherit it), restored afterwards; yields the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard <= LOW:
        pytest.skip(f"hard RLIMIT_NOFILE is {hard}: nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (LOW, hard))
    try:
        yield hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_serve_raises_the_soft_limit_to_the_hard_one(tmp_path: Path, low_soft_limit: int) -> None:
    with gateway_process(SIM, tmp_path, "--log-level", "info") as gw:
        assert gw.proc is not None
        assert limits(gw.proc.pid) == (low_soft_limit, low_soft_limit)
        assert f"file descriptors: soft limit raised from {LOW} to {low_soft_limit}" in gw.log_text()
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == LOW  # the fixture's, still: the gateway raised its own


def test_serve_says_when_the_limit_is_already_the_hard_one(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        pytest.skip("this process's soft limit is below its hard one")
    with gateway_process(SIM, tmp_path, "--log-level", "info") as gw:
        assert f"file descriptors: soft limit {hard}, already at the hard limit" in gw.log_text()
