"""Stand-ins for vLLM, TGI, llama.cpp and Ollama (`sluice sim --like/--replicas`) in a thread of the tests.

    with standin("llamacpp", load_ms=2000) as server:
        httpx.get(server.url + "/health")        # 503 "Loading model", later 200
        server.stats()                           # what reached it: GET /_sim/stats

The real servers of `tools.sim.fleet` run on their own event loop in a background thread, on free
loopback ports; the context manager returns once every replica answers HTTP at all (vLLM and TGI refuse
connections while they load), or at once with `wait=False`, and stops them on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn

from gateway.simulation.answers import Profile
from tools.sim import fleet as sim_fleet
from tools.sim.engine import BATCH, CACHE, Options

FAST = Profile(ttft_ms=5.0, tpot_ms=2.0, tokens=6)


class Standins:
    """Running stand-in replicas: `urls[i]` is replica i's base URL (no /v1)."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.urls = [f"http://127.0.0.1:{port}" for port in ports]

    @property
    def url(self) -> str:
        return self.urls[0]

    def base_url(self, replica: int = 0) -> str:
        return self.urls[replica] + "/v1"

    def stats(self, replica: int = 0) -> dict[str, Any]:
        stats: dict[str, Any] = httpx.get(self.urls[replica] + "/_sim/stats", timeout=5).json()
        return stats

    def metrics(self, replica: int = 0) -> dict[str, float]:
        """`GET /metrics` as {series: value}, the series with its labels as written."""
        text = httpx.get(self.urls[replica] + "/metrics", timeout=5).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                series, _, value = line.rpartition(" ")
                values[series.partition("{")[0]] = float(value)
        return values


@contextmanager
def standin(
    like: str = "vllm", replicas: int = 1, wait: bool = True, timeout: float = 15.0, **options: Any
) -> Iterator[Standins]:
    """Serve `replicas` stand-ins behaving like `like`.

    `options` are `Options` fields, and `ttft_ms`, `tpot_ms`, `tokens` change the profile (FAST unless told).
    """
    timing = {name: options.pop(name) for name in ("ttft_ms", "tpot_ms", "tokens") if name in options}
    block_tokens, cache_blocks = CACHE[like]
    defaults = {
        "profile": dataclasses.replace(FAST, **timing),
        "max_batch": BATCH[like],
        "block_tokens": block_tokens,
        "cache_blocks": cache_blocks,
    }
    chosen = Options(like=like, **{**defaults, **options})
    bound = sim_fleet.sockets("127.0.0.1", 0, replicas)
    running = Standins([sock.getsockname()[1] for sock in bound])
    loop = asyncio.new_event_loop()
    servers: list[uvicorn.Server] = []
    main = loop.create_task(sim_fleet.run(chosen, bound, servers.append))

    def serve() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(main)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        if wait:
            for url in running.urls:
                _wait_answers(url, timeout)
        yield running
    finally:
        loop.call_soon_threadsafe(_stop, main, servers)
        thread.join(10)
        with contextlib.suppress(RuntimeError):
            loop.close()
        for sock in bound:
            sock.close()


def _stop(main: asyncio.Task[None], servers: list[uvicorn.Server]) -> None:
    if servers:
        servers[0].should_exit = True
    else:
        main.cancel()  # still loading, not listening yet


def _wait_answers(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(url + "/_sim/stats", timeout=1.0)
            return
        except httpx.TransportError:
            time.sleep(0.01)
    raise TimeoutError(f"stand-in at {url} did not answer within {timeout} s")
