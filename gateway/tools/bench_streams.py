"""The `streams` scenario: thousands of concurrent streams through one gateway worker, and what each costs.

One simulated upstream streams slowly (first token after 200 ms, then one a second: each stream lasts about
30 s); one `sluice serve` worker (`scenarios/streams.yaml`, its pool sized for them all) sits in front. A
load generator in a process of its own (this module's `main`, raw asyncio sockets on uvloop, one connection
per stream) opens the streams evenly over a few seconds, so that all are open at once, and reads each to its
end: every token event and `[DONE]`, as many events as one stream straight from the upstream (sent beside
them, as the reference). The figures: streams complete, the gateway's peak RSS and RSS per open stream
((peak - idle) / streams), and the TTFT it added at that concurrency: TTFT through it minus the upstream's
configured TTFT (an upper bound: the upstream's own delay under load is in it), beside the gateway's own
view (`x-sluice-overhead-ms`). Every process raises its file-descriptor limit: a stream holds two sockets
in the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from gateway.pool import Pool
from gateway.quantiles import percentile
from gateway.tools.bench_figures import Check, check, ms
from gateway.tools.bench_fleet import BenchError, Child, bench_file, free_port, python_module, spawn
from gateway.tools.bench_load import CLIENT_LIMITS, wait_ready
from gateway.tools.bench_rig import START_TIMEOUT_S, BenchOptions

NAME = "streams"
CONFIG = "scenarios/streams.yaml"
TARGET_RSS_MB = 300.0
TARGET_TTFT_ADDED_P99_MS = 5.0
DATA = b"data: "
DONE = b"data: [DONE]"
OVERHEAD = b"x-sluice-overhead-ms:"


@dataclass(frozen=True, slots=True)
class Shape:
    streams: int
    open_seconds: float  # the streams start evenly over this
    ttft_ms: float
    tpot_ms: float
    tokens: int

    @property
    def stream_seconds(self) -> float:
        return (self.ttft_ms + self.tpot_ms * (self.tokens - 1)) / 1000.0


SHAPES = {
    "default": Shape(10_000, 20.0, 200.0, 1000.0, 30),
    "quick": Shape(10_000, 20.0, 200.0, 1000.0, 30),
    "smoke": Shape(200, 1.0, 200.0, 50.0, 10),
}


@dataclass(frozen=True, slots=True)
class Streams:
    shape: Shape
    completed: int  # every event and [DONE], as many as the reference stream
    errors: int
    failures: dict[str, int]  # what went wrong, by kind
    expected_events: int  # of the reference stream, straight from the upstream
    idle_rss_mb: float
    peak_rss_mb: float
    ttft_ms: list[float]  # through the gateway
    own_ms: list[float]  # x-sluice-overhead-ms
    connect_ms: list[float]  # from the start of a stream: its connection accepted
    head_ms: list[float]  # its response head read
    seconds: float  # the load generator's, start to last stream ended
    gateway_cpu_s: float  # the gateway's, over the same time

    @property
    def rss_kb_per_stream(self) -> float:
        return 1024.0 * (self.peak_rss_mb - self.idle_rss_mb) / self.shape.streams

    def added(self, q: float) -> float:
        return percentile(self.ttft_ms, q) - self.shape.ttft_ms if self.ttft_ms else math.nan

    def own(self, q: float) -> float:
        return percentile(self.own_ms, q) if self.own_ms else math.nan

    def steps(self, q: float) -> str:
        """Connection accepted / response head / first token, at quantile `q` (ms from the stream's start)."""
        found = [percentile(values, q) if values else math.nan for values in (self.connect_ms, self.head_ms)]
        return " / ".join(ms(v) for v in (*found, percentile(self.ttft_ms, q) if self.ttft_ms else math.nan))


def raise_fd_limit(needed: int) -> None:
    """Soft and hard limits up to `needed` if this process may (root may raise the hard one), else soft to hard."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        tries = [(needed, hard)]
    else:
        tries = [(max(hard, needed), max(hard, needed)), (hard, hard)]
    for limits in tries:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, limits)
            return
        except (ValueError, OSError):
            continue


def status_rss_mb(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) / 1024.0
    return math.nan


async def measure(options: BenchOptions, env: dict[str, str]) -> Streams:
    shape = SHAPES.get(options.preset, SHAPES["default"])
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    raise_fd_limit(4 * shape.streams + 4096)  # inherited: the gateway, the upstream, the load generator
    try:
        return await _measure(shape, env)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)


async def _measure(shape: Shape, env: dict[str, str]) -> Streams:
    port, gateway_port = free_port(), free_port()
    env = {**env, "SIM_SLOW_PORT": str(port)}
    sim_args = ["sim", "--port", str(port), "--ttft-ms", f"{shape.ttft_ms:g}", "--tpot-ms", f"{shape.tpot_ms:g}"]
    children: list[Child] = [
        spawn("sim slow", python_module("gateway.cli", *sim_args, "--tokens", str(shape.tokens)), None, env)
    ]
    try:
        serve = ["serve", "-c", str(bench_file(CONFIG)), "--port", str(gateway_port), "--log-level", "warning"]
        gateway = spawn("gateway streams", python_module("gateway.cli", *serve), None, env)
        children.append(gateway)
        pool = Pool(f"http://127.0.0.1:{gateway_port}", CLIENT_LIMITS)
        try:
            await wait_ready(gateway, pool, b"/readyz", time.monotonic() + START_TIMEOUT_S)
        finally:
            await pool.aclose()
        idle = status_rss_mb(gateway.popen.pid, "VmRSS:")
        load = python_module(
            "gateway.tools.bench_streams",
            *("--port", str(gateway_port), "--reference-port", str(port), "--streams", str(shape.streams)),
            *("--open-seconds", f"{shape.open_seconds:g}", "--ttft-ms", f"{shape.ttft_ms:g}"),
        )
        cpu = gateway.cpu_seconds()
        budget = shape.open_seconds + shape.stream_seconds + 60.0
        try:
            done = await asyncio.to_thread(subprocess.run, load, capture_output=True, env=env, timeout=budget)
        except subprocess.TimeoutExpired as exc:
            raise BenchError(f"streams: the load generator did not finish within {budget:.0f} s") from exc
        gateway.check_alive()
        if done.returncode != 0:
            raise BenchError(f"streams: the load generator failed: {done.stderr.decode(errors='replace')[-2000:]}")
        peak = status_rss_mb(gateway.popen.pid, "VmHWM:")
        cpu = gateway.cpu_seconds() - cpu
    finally:
        for child in reversed(children):
            child.stop()
    found = orjson.loads(done.stdout)
    return Streams(
        shape=shape,
        completed=found["completed"],
        errors=shape.streams - found["completed"],
        failures=found["failures"],
        expected_events=found["expected_events"],
        idle_rss_mb=idle,
        peak_rss_mb=peak,
        ttft_ms=found["ttft_ms"],
        own_ms=found["own_ms"],
        connect_ms=found["connect_ms"],
        head_ms=found["head_ms"],
        seconds=found["seconds"],
        gateway_cpu_s=cpu,
    )


def checks(s: Streams) -> list[Check]:
    n = s.shape.streams
    return [
        check(NAME, f"streams completed of {n:,}", s.completed, n, "", at_least=True),
        check(NAME, f"gateway peak RSS, {n:,} open streams", s.peak_rss_mb, TARGET_RSS_MB, "MB"),
        check(NAME, f"TTFT added p99, {n:,} open streams", s.added(0.99), TARGET_TTFT_ADDED_P99_MS, "ms"),
    ]


def render(s: Streams) -> list[str]:
    sh = s.shape
    failures = ", ".join(f"{kind}: {count}" for kind, count in sorted(s.failures.items())) or "none"
    return [
        "## Streams: concurrency in one worker",
        "",
        f"{sh.streams:,} streams opened over {sh.open_seconds:g} s through one worker (`streams.yaml`), each "
        f"{sh.tokens} tokens from `sluice sim --ttft-ms {sh.ttft_ms:g} --tpot-ms {sh.tpot_ms:g}` (about "
        f"{sh.stream_seconds:.0f} s), read to the end by a load generator in its own process; unpinned.",
        "",
        "| streams | completed | gateway RSS idle / peak MB | RSS per open stream KB | TTFT added p50 / p99 ms "
        "| own view p50 / p99 ms | load generator s |",
        "|---|---|---|---|---|---|---|",
        f"| {sh.streams:,} | {s.completed:,} | {s.idle_rss_mb:.0f} / {s.peak_rss_mb:.0f} | {s.rss_kb_per_stream:.1f} "
        f"| {ms(s.added(0.5))} / {ms(s.added(0.99))} | {ms(s.own(0.5), 3)} / {ms(s.own(0.99), 3)} | {s.seconds:.0f} |",
        "",
        f"- Each complete stream: {s.expected_events} events with `[DONE]`, as one straight from the upstream. "
        f"Failures: {failures}.",
        f"- Gateway CPU: {s.gateway_cpu_s:.1f} s over the load generator's {s.seconds:.0f} s "
        f"({100.0 * s.gateway_cpu_s / s.seconds:.0f} % of a core; {1000.0 / sh.tpot_ms:g} token/s a stream).",
        f"- From a stream's start, connected / head / first token: p50 {s.steps(0.5)} ms, p99 {s.steps(0.99)} ms.",
        f"- TTFT added = TTFT through the gateway - the upstream's configured {sh.ttft_ms:g} ms: the upstream's "
        "own delay at this concurrency is in it, so it bounds the gateway's from above.",
    ]


# The load generator (its own process)


@dataclass(slots=True)
class Tally:
    completed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    ttft_ms: list[float] = field(default_factory=list)
    own_ms: list[float] = field(default_factory=list)
    connect_ms: list[float] = field(default_factory=list)
    head_ms: list[float] = field(default_factory=list)

    def fail(self, kind: str) -> None:
        self.failures[kind] = self.failures.get(kind, 0) + 1


def request(port: int, index: int) -> bytes:
    body = orjson.dumps({"model": "slow", "prompt": f"Tell me about rivers ({index}).", "stream": True})
    head = f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
    return f"{head}content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body


async def stream(port: int, index: int) -> tuple[str, int, float, float, float, float]:
    """One stream read to its end: (failure or "", events, TTFT ms, own view ms or NaN, connect ms, head ms)."""
    started = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as exc:
        return f"connect: {type(exc).__name__}", 0, math.nan, math.nan, math.nan, math.nan
    connected = time.perf_counter()
    try:
        writer.write(request(port, index))
        head = await reader.readuntil(b"\r\n\r\n")
        headed = time.perf_counter()
        if not head.startswith(b"HTTP/1.1 200"):
            return f"status {head[9:12].decode(errors='replace')}", 0, math.nan, math.nan, math.nan, math.nan
        own = math.nan
        for line in head.lower().split(b"\r\n"):
            if line.startswith(OVERHEAD):
                own = float(line[len(OVERHEAD) :])
        events, first, done, tail = 0, 0.0, False, b""
        # Events are counted across reads: a `data: ` split between two reads is counted once, in the later.
        while data := await reader.read(65536):
            joined = tail + data
            found = joined.count(DATA)
            if found and not first:
                first = time.perf_counter()
            events += found
            done = done or DONE in joined
            tail = joined[-(len(DONE) - 1) :]
            events -= tail.count(DATA)  # counted again with the next read
        events += tail.count(DATA)
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        return f"read: {type(exc).__name__}", 0, math.nan, math.nan, math.nan, math.nan
    finally:
        writer.close()
    if not done:
        return "no [DONE]", events, math.nan, math.nan, math.nan, math.nan
    return "", events, (first - started) * 1000.0, own, (connected - started) * 1000.0, (headed - started) * 1000.0


async def load(args: argparse.Namespace) -> dict[str, object]:
    tally = Tally()
    reference = asyncio.create_task(stream(args.reference_port, -1))
    step = args.open_seconds / args.streams
    tasks: list[asyncio.Task[tuple[str, int, float, float, float, float]]] = []
    started = time.perf_counter()
    for i in range(args.streams):
        wait = started + i * step - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(stream(args.port, i)))
    failure, expected, *_ = await reference
    if failure:
        raise SystemExit(f"the reference stream straight from the upstream failed: {failure}")
    for failure, events, ttft, own, connect, head in await asyncio.gather(*tasks):
        if failure:
            tally.fail(failure)
        elif events != expected:
            tally.fail(f"{events} events, not {expected}")
        else:
            tally.completed += 1
            tally.ttft_ms.append(ttft)
            tally.connect_ms.append(connect)
            tally.head_ms.append(head)
            if not math.isnan(own):
                tally.own_ms.append(own)
    return {
        "completed": tally.completed,
        "failures": tally.failures,
        "expected_events": expected,
        "ttft_ms": tally.ttft_ms,
        "own_ms": tally.own_ms,
        "connect_ms": tally.connect_ms,
        "head_ms": tally.head_ms,
        "seconds": time.perf_counter() - started,
    }


def main() -> None:
    cli = argparse.ArgumentParser(prog="bench_streams", description="Open many streams at once; JSON on stdout.")
    cli.add_argument("--port", type=int, required=True)
    cli.add_argument("--reference-port", type=int, required=True)
    cli.add_argument("--streams", type=int, required=True)
    cli.add_argument("--open-seconds", type=float, required=True)
    cli.add_argument("--ttft-ms", type=float, required=True)
    args = cli.parse_args()
    raise_fd_limit(2 * args.streams + 1024)
    import uvloop

    sys.stdout.buffer.write(orjson.dumps(uvloop.run(load(args))))


if __name__ == "__main__":
    main()
