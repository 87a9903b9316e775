"""The time to first token the bare gateway adds at a low rate, and the system calls a stream costs it.

    python3 -m bench.lowrate_ttft [--streams 200] [--rate 50] [--strace FILE]

A simulated upstream (`sluice sim --ttft-ms 20 --tpot-ms 5 --tokens 8`) and `sluice serve` (`plugins: []`, an
`openai` backend on it), started from the working directory's tree. After 100 streams each way to warm up,
streams go alternately straight to the upstream and through the gateway, `--rate` a second in all, each on a
connection of its own, as a client that opens one a stream does; each is timed from the connect to the first
chunk holding a token. Printed: each side's p50 and p90, the difference of the p50s and the median of paired
differences. With `--strace FILE`, `strace -c -f` is attached to the gateway over the measured streams and its
table written to FILE (strace slows every system call, so the rate falls and the time-driven calls, uvicorn's
tick ten times a second, weigh more a stream than without it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

from gateway.upstream.pool import Pool
from tools.bench.fleet import Child, free_port, python_module, spawn
from tools.bench.load import CLIENT_LIMITS, wait_ready

FIRST_TOKEN = re.compile(rb'"content":"[^"]')
BODY = b'{"model":"fast","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":8}'
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY)
)
WARMUP = 100


async def stream(port: int) -> float:
    """One stream on a new connection: milliseconds from the connect to the first token."""
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(REQUEST)
    seen = b""
    first = 0.0
    while chunk := await reader.read(65536):
        seen += chunk
        if not first and FIRST_TOKEN.search(seen):
            first = time.perf_counter()
    writer.close()
    if not first or not seen.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"a stream failed: {seen[:300]!r}")
    return (first - started) * 1000.0


async def ready(child: Child, port: int, path: bytes) -> None:
    pool = Pool(f"http://127.0.0.1:{port}", CLIENT_LIMITS)
    try:
        await wait_ready(child, pool, path, time.monotonic() + 60.0)
    finally:
        await pool.aclose()


def p(values: list[float], q: float) -> float:
    return sorted(values)[int(q * (len(values) - 1))]


async def measure(streams: int, rate: float, strace: str | None) -> str:
    env = dict(os.environ)
    sim_port, gateway_port = free_port(), free_port()
    sim_args = ["sim", "--port", str(sim_port), "--ttft-ms", "20", "--tpot-ms", "5", "--tokens", "8"]
    sim = spawn("sim", python_module("gateway.cli", *sim_args), None, env)
    config = {
        "listen": {"host": "127.0.0.1", "port": gateway_port},
        "backends": {"fast": {"type": "openai", "base_url": f"http://127.0.0.1:{sim_port}/v1"}},
        "models": {"fast": {"backend": "fast"}},
        "plugins": [],
    }
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        serve = python_module("gateway.cli", "serve", "-c", str(path), "--log-level", "warning")
        gateway = spawn("gateway", serve, None, env, cwd=os.getcwd())
        try:
            await ready(sim, sim_port, b"/health")
            await ready(gateway, gateway_port, b"/readyz")
            for _ in range(WARMUP):
                await stream(gateway_port)
                await stream(sim_port)
            tracer = None
            if strace:
                command = ["strace", "-c", "-f", "-p", str(gateway.popen.pid), "-o", strace]
                tracer = await asyncio.create_subprocess_exec(*command, stderr=subprocess.DEVNULL)
                await asyncio.sleep(2.0)  # attached to every thread before the first stream
            direct: list[float] = []
            through: list[float] = []
            due = time.perf_counter()
            for i in range(2 * streams):
                due += 1.0 / rate
                if i % 2:
                    through.append(await stream(gateway_port))
                else:
                    direct.append(await stream(sim_port))
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
            if tracer is not None:
                tracer.send_signal(signal.SIGINT)
                await asyncio.wait_for(tracer.wait(), 30.0)
        finally:
            gateway.stop()
            sim.stop()
    paired = statistics.median(t - d for d, t in zip(direct, through, strict=True))
    return (
        f"direct p50 {p(direct, 0.5):.3f} ms, p90 {p(direct, 0.9):.3f}; through the gateway p50 {p(through, 0.5):.3f}"
        f" ms, p90 {p(through, 0.9):.3f}; added at p50 {p(through, 0.5) - p(direct, 0.5):.3f} ms, median of paired"
        f" differences {paired:.3f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--streams", type=int, default=200, help="streams each way (default 200)")
    parser.add_argument("--rate", type=float, default=50.0, help="streams a second, both ways together (50)")
    parser.add_argument("--strace", help="attach `strace -c -f` to the gateway; its table goes to this file")
    args = parser.parse_args()
    print(asyncio.run(measure(args.streams, args.rate, args.strace)))
    if args.strace:
        print(Path(args.strace).read_text(), end="")


if __name__ == "__main__":
    main()
