"""`sluice serve` raises its soft file-descriptor limit to the hard one before it binds, and says so."""

from __future__ import annotations

import asyncio
import collections
import resource
import shutil
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


CAPPED = 1024  # the gateway's whole descriptor limit, soft and hard, for the test below
SLOW = "backends: {s: {type: simulated, ttft_ms: 300, tpot_ms: 100, tokens: 8}}\nmodels: {m: {backend: s}}\n"
STREAM = b'{"model":"m","prompt":"hello","stream":true}'


async def one_stream(port: int) -> str:
    """One stream to its end: "ok", "503" (with retry-after), or what went wrong."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as exc:
        return f"connect: {type(exc).__name__}"
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(STREAM), STREAM)
        )
        data = await reader.read(-1)
    except OSError as exc:
        return f"read: {type(exc).__name__}"
    finally:
        writer.close()
    head = data.partition(b"\r\n\r\n")[0].lower()
    if head.startswith(b"http/1.1 200") and b"data: [DONE]" in data:
        return "ok"
    if head.startswith(b"http/1.1 503") and b"\r\nretry-after: " in head and b'"error"' in data:
        return "503"
    return f"answer: {data[:80]!r}"


async def streams(port: int, count: int, seconds: float) -> list[str]:
    tasks = []
    for _ in range(count):
        tasks.append(asyncio.create_task(one_stream(port)))
        await asyncio.sleep(seconds / count)
    return list(await asyncio.gather(*tasks))


def test_at_the_descriptor_limit_requests_get_503_never_a_reset(tmp_path: Path) -> None:
    if shutil.which("prlimit") is None:
        pytest.skip("prlimit (util-linux) not found: it lowers the gateway's limit")
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 2 * CAPPED:
        pytest.skip("this process's own limit is too low for the test's client")
    with gateway_process(SLOW, tmp_path, prefix=("prlimit", f"--nofile={CAPPED}:{CAPPED}", "--")) as gw:
        assert gw.proc is not None
        assert limits(gw.proc.pid) == (CAPPED, CAPPED)
        # More streams than the limit, opened over a second and a half, each open about a second.
        found = asyncio.run(streams(gw.port, 1500, 1.5))
        log = gw.log_text()
    outcomes = collections.Counter(found)
    assert set(outcomes) <= {"ok", "503"}, outcomes
    assert outcomes["503"] > 0, outcomes
    assert outcomes["ok"] >= 400, outcomes
    assert log.count("file descriptors: ") == 1, log
