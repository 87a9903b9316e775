"""CPU per Redis call: redis-py's asyncio client, as the store used it before, against the lean RESP client.

    python3 -m bench.redis_client                      # 20,000 GETs, 32 in flight, a throwaway redis-server
    python3 -m bench.redis_client --url redis://127.0.0.1:6379/0 --calls 50000 --inflight 64
    python3 -m bench.redis_client --url redis+cluster://127.0.0.1:7000   # against redis-py's cluster client

Each client runs on uvloop (the gateway's loop; `--loop asyncio` for the default one) with `inflight`
tasks calling GET in a loop until `calls` are done. CPU per call is this process's `time.process_time()`
over the run divided by the calls (the server's CPU is not counted). Each client is warmed up first and
measured `--rounds` times; the report gives every round, so the spread is visible.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import redis.asyncio as aioredis
import uvloop
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.state.resp import node_urls
from gateway.state.store import Store

Get = Callable[[str], Awaitable[Any]]


@contextmanager
def throwaway_server() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server), or pass --url")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="sluice-bench-redis-")
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


async def drive(get: Get, calls: int, inflight: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) for `calls` GETs with `inflight` of them at a time."""
    remaining = calls

    async def worker(n: int) -> None:
        nonlocal remaining
        key = f"bench:{n % 8}"
        while remaining > 0:
            remaining -= 1
            await get(key)

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(n) for n in range(inflight)))
    return time.process_time() - cpu, time.perf_counter() - wall


def redis_py(url: str) -> tuple[Get, Callable[[], Awaitable[None]]]:
    """The store's client before: a blocking pool of up to 64 connections, one retry on a broken one.

    Its timeouts are 1 s here, not the store's 50 ms, as for the new client: this measures CPU, not faults.
    """
    if "+cluster://" in url:  # redis-py's own cluster client, for a cluster URL
        cluster: Any = RedisCluster.from_url(node_urls(url)[0], socket_timeout=1.0, socket_connect_timeout=1.0)

        async def cluster_get(key: str) -> Any:
            return await cluster.execute_command("GET", key)

        return cluster_get, cluster.aclose
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=64,
        timeout=1.0,
        socket_timeout=1.0,
        socket_connect_timeout=1.0,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        health_check_interval=30,
    )
    client: Any = aioredis.Redis(connection_pool=pool)

    async def get(key: str) -> Any:
        return await client.execute_command("GET", key)

    async def close() -> None:
        await client.aclose()
        await pool.aclose()

    return get, close


def lean(url: str) -> tuple[Get, Callable[[], Awaitable[None]]]:
    """The store now: the breaker in front of the pipelined RESP client."""
    store = Store(url, timeout_s=1.0)

    async def get(key: str) -> Any:
        return await store.execute("GET", key)

    return get, store.aclose


async def measure(url: str, calls: int, inflight: int, rounds: int) -> list[tuple[str, list[tuple[float, float]]]]:
    results = []
    before = "redis-py asyncio RedisCluster" if "+cluster://" in url else "redis-py asyncio (the store before)"
    for name, make in ((before, redis_py), ("sluice RESP client (store.py)", lean)):
        get, close = make(url)
        try:
            await get("warm-up")
            await drive(get, min(calls, 2000), inflight)
            results.append((name, [await drive(get, calls, inflight) for _ in range(rounds)]))
        finally:
            await close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(prog="python3 -m bench.redis_client", description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running Redis (default: start a throwaway redis-server)")
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--inflight", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = parser.parse_args()
    factory = uvloop.new_event_loop if args.loop == "uvloop" else asyncio.new_event_loop
    server = nullcontext(args.url) if args.url else throwaway_server()
    with server as url, asyncio.Runner(loop_factory=factory) as runner:
        results = runner.run(measure(url, args.calls, args.inflight, args.rounds))
    print(f"{args.calls:,} GETs, {args.inflight} in flight, {args.loop}; CPU per call (µs) and calls/s, per round\n")
    print("| client | CPU per call (µs) | calls/s |")
    print("|---|---|---|")
    for name, runs in results:
        cpu = " / ".join(f"{c / args.calls * 1e6:.0f}" for c, _ in runs)
        rate = " / ".join(f"{args.calls / w:,.0f}" for _, w in runs)
        print(f"| {name} | {cpu} | {rate} |")


if __name__ == "__main__":
    main()
