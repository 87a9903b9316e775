"""The `streams` scenario: thousands of concurrent streams through one gateway worker, and what each costs.

One simulated upstream streams slowly (first token after 200 ms, then one a second: each stream lasts about
30 s); one `sluice serve` worker (`scenarios/streams.yaml`, its pool sized for them all) sits in front. A
load generator in a process of its own (this module's `main`, raw asyncio sockets on uvloop, one connection
per stream) opens the streams evenly over a few seconds, so that all are open at once, and reads each to its
end: every token event and `[DONE]`, as many events as one stream straight from the upstream (sent beside
them, as the reference). The figures: streams complete, the gateway's peak RSS and RSS per open stream
((peak - idle) / streams), and the TTFT it added at that concurrency. The upstream stamps each stream's first
token with the time it wrote it (`sluice sim --stamp-first-token`, on the host's monotonic clock, which this
load generator reads too): the TTFT added is from that write to the client's read of it, so the upstream's own
delay at this concurrency (its timers fire late with 10,000 streams in one process) is not in it, while
everything between the two is (the gateway, both sockets, the load generator's own lag). The TTFT through the
gateway is reported beside it, with the gateway's own view (`x-sluice-overhead-ms`).

Every process raises its file-descriptor limit where it may: a stream holds two sockets in the gateway (its
client's and its upstream's), so the gateway's limit, the most it held open, the listen-queue overflows of
the machine and any "Too many open files" it logged are reported with the failures. Where the limit cannot
carry the shape's streams, the run has as many as it can (the gateway's connection cap,
`gateway.server.protocol.connection_cap`): on a machine whose hard limit is 20,000, 9,936 rather than 10,000.
A stream past the cap gets a 503 with `retry-after` (counted as refused, apart from the failures), never a reset.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
import os
import resource
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import orjson

from gateway.server.protocol import RESERVED_FDS
from gateway.telemetry.quantiles import percentile
from gateway.upstream.pool import Pool
from tools.bench.figures import Check, check, ms
from tools.bench.fleet import BenchError, Child, bench_file, free_port, proc_net_counter, python_module, spawn
from tools.bench.load import CLIENT_LIMITS, wait_ready
from tools.bench.rig import START_TIMEOUT_S, BenchOptions

NAME = "streams"
CONFIG = "scenarios/streams.yaml"
TARGET_RSS_MB = 300.0
TARGET_TTFT_ADDED_P99_MS = 5.0
DATA = b"data: "
DONE = b"data: [DONE]"
OVERHEAD = b"x-sluice-overhead-ms:"
STAMP = b": sent "  # the upstream's first-token stamp
DIRECT_EVERY = 50  # one stream in this many has a twin straight to the upstream, opened at the same moment
REFUSED = "status 503 with retry-after"  # the gateway at its descriptor limit: refused, not failed
EMFILE = ("Too many open files", "out of file descriptors")  # what the gateway logs at its limit


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
    refused: int  # answered 503 (the gateway at its descriptor limit), not failures
    errors: int
    failures: dict[str, int]  # what went wrong, by kind
    expected_events: int  # of the reference stream, straight from the upstream
    idle_rss_mb: float
    peak_rss_mb: float
    ttft_ms: list[float]  # through the gateway
    written_ms: list[float]  # from the start of a stream: the upstream wrote its first token
    transit_ms: list[float]  # the upstream's write of the first token to the client's read of it
    direct_transit_ms: list[float]  # the same for streams straight from the upstream, opened among the others
    own_ms: list[float]  # x-sluice-overhead-ms
    connect_ms: list[float]  # from the start of a stream: its connection accepted
    head_ms: list[float]  # its response head read
    seconds: float  # the load generator's, start to last stream ended
    gateway_cpu_s: float  # the gateway's, over the same time
    fd_limit: int  # the gateway's soft RLIMIT_NOFILE
    idle_fds: int  # what it held open before the load: its own, without streams
    peak_fds: int  # the most it held open, sampled every second
    fd_errors: int  # "Too many open files" lines in its log
    listen_overflows: int  # machine-wide, during the load: a full accept queue
    listen_drops: int

    @property
    def rss_kb_per_stream(self) -> float:
        return 1024.0 * (self.peak_rss_mb - self.idle_rss_mb) / self.shape.streams

    def added(self, q: float) -> float:
        """TTFT the gateway added at quantile `q`: from the upstream's write of the first token to the client's
        read, through the gateway, less the same straight from the upstream (what this load generator's own lag
        and the loopback cost, at the same moments)."""
        return self.transit(q) - self.direct(q)

    def transit(self, q: float) -> float:
        return percentile(self.transit_ms, q) if self.transit_ms else math.nan

    def direct(self, q: float) -> float:
        return percentile(self.direct_transit_ms, q) if self.direct_transit_ms else math.nan

    def through(self, q: float) -> float:
        return percentile(self.ttft_ms, q) if self.ttft_ms else math.nan

    def written(self, q: float) -> float:
        return percentile(self.written_ms, q) if self.written_ms else math.nan

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


async def measure(
    options: BenchOptions, env: dict[str, str], max_fds: int | None = None, shape: Shape | None = None
) -> Streams:
    """The preset's shape (or `shape`), with as many streams as the gateway's descriptor limit carries
    (`max_fds`, soft and hard, lowers it: `prlimit` runs the gateway under it)."""
    shape = shape or SHAPES.get(options.preset, SHAPES["default"])
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    raise_fd_limit(4 * shape.streams + 4096)  # inherited: the gateway, the upstream, the load generator
    try:
        gateway_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        if max_fds is not None:
            gateway_limit = min(gateway_limit, max_fds)
        streams = min(shape.streams, max((gateway_limit - RESERVED_FDS) // 2, 1))
        return await _measure(replace(shape, streams=streams), env, max_fds)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)


async def _measure(shape: Shape, env: dict[str, str], max_fds: int | None = None) -> Streams:
    port, gateway_port = free_port(), free_port()
    env = {**env, "SIM_SLOW_PORT": str(port)}
    sim_args = ["sim", "--port", str(port), "--ttft-ms", f"{shape.ttft_ms:g}", "--tpot-ms", f"{shape.tpot_ms:g}"]
    sim_args.append("--stamp-first-token")
    children: list[Child] = [
        spawn("sim slow", python_module("gateway.cli", *sim_args, "--tokens", str(shape.tokens)), None, env)
    ]
    try:
        serve = ["serve", "-c", str(bench_file(CONFIG)), "--port", str(gateway_port), "--log-level", "warning"]
        prefix = [] if max_fds is None else ["prlimit", f"--nofile={max_fds}:{max_fds}", "--"]
        gateway = spawn("gateway streams", [*prefix, *python_module("gateway.cli", *serve)], None, env)
        children.append(gateway)
        pool = Pool(f"http://127.0.0.1:{gateway_port}", CLIENT_LIMITS)
        try:
            await wait_ready(gateway, pool, b"/readyz", time.monotonic() + START_TIMEOUT_S)
        finally:
            await pool.aclose()
        idle = status_rss_mb(gateway.popen.pid, "VmRSS:")
        idle_fds = len(os.listdir(f"/proc/{gateway.popen.pid}/fd"))
        # The figures come back in a file: over the stdout pipe they were once cut at 256 KiB.
        report = Path(tempfile.mkdtemp(prefix="sluice-bench-streams-")) / "report.json"
        load = python_module(
            "tools.bench.streams",
            *("--port", str(gateway_port), "--reference-port", str(port), "--streams", str(shape.streams)),
            *("--open-seconds", f"{shape.open_seconds:g}", "--ttft-ms", f"{shape.ttft_ms:g}"),
            *("--report", str(report)),
        )
        cpu = gateway.cpu_seconds()
        budget = shape.open_seconds + shape.stream_seconds + 60.0
        before = listen_counters()
        held = Descriptors(gateway.popen.pid)
        fds = asyncio.get_running_loop().create_task(held.watch())
        try:
            done = await asyncio.to_thread(subprocess.run, load, capture_output=True, env=env, timeout=budget)
        except subprocess.TimeoutExpired as exc:
            raise BenchError(f"streams: the load generator did not finish within {budget:.0f} s") from exc
        finally:
            fds.cancel()
        after = listen_counters()
        gateway.check_alive()
        limit = fd_limit(gateway.popen.pid)
        emfile = logged(gateway, EMFILE)
        if done.returncode != 0:
            raise BenchError(f"streams: the load generator failed: {done.stderr.decode(errors='replace')[-2000:]}")
        peak = status_rss_mb(gateway.popen.pid, "VmHWM:")
        cpu = gateway.cpu_seconds() - cpu
    finally:
        for child in reversed(children):
            child.stop()
    try:
        found = orjson.loads(report.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise BenchError(f"streams: the load generator's report is unreadable: {exc}") from None
    finally:
        shutil.rmtree(report.parent, ignore_errors=True)
    return Streams(
        shape=shape,
        completed=found["completed"],
        refused=found["refused"],
        errors=shape.streams - found["completed"] - found["refused"],
        failures=found["failures"],
        expected_events=found["expected_events"],
        idle_rss_mb=idle,
        peak_rss_mb=peak,
        ttft_ms=found["ttft_ms"],
        written_ms=found["written_ms"],
        transit_ms=found["transit_ms"],
        direct_transit_ms=found["direct_transit_ms"],
        own_ms=found["own_ms"],
        connect_ms=found["connect_ms"],
        head_ms=found["head_ms"],
        seconds=found["seconds"],
        gateway_cpu_s=cpu,
        fd_limit=limit,
        idle_fds=idle_fds,
        peak_fds=held.most,
        fd_errors=emfile,
        listen_overflows=round(after[0] - before[0]),
        listen_drops=round(after[1] - before[1]),
    )


def listen_counters() -> tuple[float, float]:
    """Machine-wide: connections dropped because an accept queue was full, and all those dropped at listen."""
    overflows = proc_net_counter("/proc/net/netstat", "TcpExt:", "ListenOverflows")
    return overflows, proc_net_counter("/proc/net/netstat", "TcpExt:", "ListenDrops")


@dataclass(slots=True)
class Descriptors:
    """The most descriptors a process held open, sampled every second while `watch` runs."""

    pid: int
    most: int = 0

    async def watch(self) -> None:
        while True:
            with contextlib.suppress(OSError):
                self.most = max(self.most, len(os.listdir(f"/proc/{self.pid}/fd")))
            await asyncio.sleep(1.0)


def fd_limit(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    return 0


def logged(child: Child, markers: tuple[str, ...]) -> int:
    child.log.seek(0)
    text = child.log.read().decode(errors="replace")
    return sum(text.count(marker) for marker in markers)


def checks(s: Streams) -> list[Check]:
    n = s.shape.streams
    return [
        check(NAME, f"streams completed of {n:,}", s.completed, n, "", at_least=True),
        check(NAME, "streams failed (reset, cut; 503s apart)", s.errors, 0, ""),
        check(NAME, f"gateway peak RSS, {n:,} open streams", s.peak_rss_mb, TARGET_RSS_MB, "MB"),
        check(NAME, f"TTFT added p99, {n:,} open streams", s.added(0.99), TARGET_TTFT_ADDED_P99_MS, "ms"),
    ]


def render(s: Streams) -> list[str]:
    sh = s.shape
    failures = ", ".join(f"{kind}: {count}" for kind, count in sorted(s.failures.items())) or "none"
    needed = 2 * sh.streams
    return [
        "## Streams: concurrency in one worker",
        "",
        f"{sh.streams:,} streams opened over {sh.open_seconds:g} s through one worker (`streams.yaml`), each "
        f"{sh.tokens} tokens from `sluice sim --ttft-ms {sh.ttft_ms:g} --tpot-ms {sh.tpot_ms:g} --stamp-first-token` "
        f"(about {sh.stream_seconds:.0f} s), read to the end by a load generator in its own process; unpinned.",
        "",
        "| streams | completed | gateway RSS idle / peak MB | RSS per open stream KB | TTFT added p50 / p99 ms "
        "| own view p50 / p99 ms | load generator s |",
        "|---|---|---|---|---|---|---|",
        f"| {sh.streams:,} | {s.completed:,} | {s.idle_rss_mb:.0f} / {s.peak_rss_mb:.0f} | {s.rss_kb_per_stream:.1f} "
        f"| {ms(s.added(0.5))} / {ms(s.added(0.99))} | {ms(s.own(0.5), 3)} / {ms(s.own(0.99), 3)} | {s.seconds:.0f} |",
        "",
        f"- TTFT added: from the upstream writing a stream's first token (its stamp) to the load generator reading it, "
        f"through the gateway (p50 {ms(s.transit(0.5))} / p99 {ms(s.transit(0.99))} ms) less the same for "
        f"{len(s.direct_transit_ms)} streams straight from the upstream opened among them (p50 {ms(s.direct(0.5))} / "
        f"p99 {ms(s.direct(0.99))} ms: the load generator's own lag). The upstream's own delay is left out: it wrote "
        "first tokens "
        f"p50 {ms(s.written(0.5))} / p99 {ms(s.written(0.99))} ms after a stream's start (configured: "
        f"{sh.ttft_ms:g} ms), and TTFT through the gateway was p50 {ms(s.through(0.5))} / p99 "
        f"{ms(s.through(0.99))} ms.",
        f"- Each complete stream: {s.expected_events} events with `[DONE]`, as one straight from the upstream. "
        f"Refused with 503 (at the descriptor limit): {s.refused}. Failures: {failures}.",
        f"- Descriptors: the gateway may hold {s.fd_limit:,} (its soft limit, raised to the hard one) and held at "
        f"most {s.peak_fds:,}; {sh.streams:,} streams need {needed:,} (a client and an upstream socket each) and "
        f"the {s.idle_fds} it held idle (its warm upstream connections among them), about {needed + s.idle_fds:,} "
        "in all; it logged running out "
        f"{s.fd_errors} time(s). Listen-queue overflows, machine-wide: {s.listen_overflows} ({s.listen_drops} "
        "dropped at listen).",
        f"- Gateway CPU: {s.gateway_cpu_s:.1f} s over the load generator's {s.seconds:.0f} s "
        f"({100.0 * s.gateway_cpu_s / s.seconds:.0f} % of a core; {1000.0 / sh.tpot_ms:g} token/s a stream).",
        f"- From a stream's start, connected / head / first token: p50 {s.steps(0.5)} ms, p99 {s.steps(0.99)} ms.",
    ]


# The load generator (its own process)


@dataclass(slots=True)
class Tally:
    completed: int = 0
    refused: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    ttft_ms: list[float] = field(default_factory=list)
    written_ms: list[float] = field(default_factory=list)
    transit_ms: list[float] = field(default_factory=list)
    own_ms: list[float] = field(default_factory=list)
    connect_ms: list[float] = field(default_factory=list)
    head_ms: list[float] = field(default_factory=list)

    def fail(self, kind: str) -> None:
        self.failures[kind] = self.failures.get(kind, 0) + 1


@dataclass(slots=True)
class Read:
    """One stream read to its end (ms from its start, NaN where not reached)."""

    failure: str = ""
    events: int = 0
    connect_ms: float = math.nan
    head_ms: float = math.nan
    ttft_ms: float = math.nan  # the first token read
    written_ms: float = math.nan  # the upstream wrote it (its stamp)
    own_ms: float = math.nan  # x-sluice-overhead-ms

    @property
    def transit_ms(self) -> float:
        return self.ttft_ms - self.written_ms


def request(port: int, index: int) -> bytes:
    body = orjson.dumps({"model": "slow", "prompt": f"Tell me about rivers ({index}).", "stream": True})
    head = f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
    return f"{head}content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body


def stamp(data: bytes) -> float:
    """The upstream's `: sent SECONDS` before the first token, or NaN."""
    at = data.find(STAMP)
    if at < 0:
        return math.nan
    end = data.find(b"\n", at)
    try:
        return float(data[at + len(STAMP) : end])
    except ValueError:
        return math.nan


async def stream(port: int, index: int) -> Read:
    started = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as exc:
        return Read(f"connect: {type(exc).__name__}")
    out = Read(connect_ms=(time.perf_counter() - started) * 1000.0)
    try:
        writer.write(request(port, index))
        head = await reader.readuntil(b"\r\n\r\n")
        out.head_ms = (time.perf_counter() - started) * 1000.0
        if head.startswith(b"HTTP/1.1 503") and b"\r\nretry-after: " in head.lower():
            return Read(REFUSED)
        if not head.startswith(b"HTTP/1.1 200"):
            return Read(f"status {head[9:12].decode(errors='replace')}")
        for line in head.lower().split(b"\r\n"):
            if line.startswith(OVERHEAD):
                out.own_ms = float(line[len(OVERHEAD) :])
        events, done, tail = 0, False, b""
        # Events are counted across reads: a `data: ` split between two reads is counted once, in the later.
        while data := await reader.read(65536):
            joined = tail + data
            found = joined.count(DATA)
            if found and math.isnan(out.ttft_ms):
                out.ttft_ms = (time.perf_counter() - started) * 1000.0
                out.written_ms = (stamp(joined) - started) * 1000.0
            events += found
            done = done or DONE in joined
            tail = joined[-(len(DONE) - 1) :]
            events -= tail.count(DATA)  # counted again with the next read
        out.events = events + tail.count(DATA)
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        return Read(f"read: {type(exc).__name__}")
    finally:
        writer.close()
    if not done:
        return Read("no [DONE]", out.events)
    return out


async def load(args: argparse.Namespace) -> dict[str, object]:
    # No collections while streams run: one of everything this process holds would stall every stream at once
    # (hundreds of ms with 10,000 open), and show as the gateway's delay. It runs for a minute; garbage can wait.
    gc.collect()
    gc.freeze()
    gc.disable()
    tally = Tally()
    reference = asyncio.create_task(stream(args.reference_port, -1))
    step = args.open_seconds / args.streams
    tasks: list[asyncio.Task[Read]] = []
    beside: list[asyncio.Task[Read]] = []  # straight to the upstream, at the same moments
    started = time.perf_counter()
    for i in range(args.streams):
        wait = started + i * step - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(stream(args.port, i)))
        if i % DIRECT_EVERY == DIRECT_EVERY // 2:
            beside.append(asyncio.create_task(stream(args.reference_port, -i)))
    direct = await reference
    if direct.failure:
        raise SystemExit(f"the reference stream straight from the upstream failed: {direct.failure}")
    # The direct streams' failures are not the gateway's: the upstream's and this load generator's own state shows.
    direct_transit = [
        r.transit_ms for r in await asyncio.gather(*beside) if not r.failure and r.events == direct.events
    ]
    for read in await asyncio.gather(*tasks):
        if read.failure == REFUSED:
            tally.refused += 1
        elif read.failure:
            tally.fail(read.failure)
        elif read.events != direct.events:
            tally.fail(f"{read.events} events, not {direct.events}")
        else:
            tally.completed += 1
            tally.ttft_ms.append(read.ttft_ms)
            tally.connect_ms.append(read.connect_ms)
            tally.head_ms.append(read.head_ms)
            if not math.isnan(read.written_ms):
                tally.written_ms.append(read.written_ms)
                tally.transit_ms.append(read.transit_ms)
            if not math.isnan(read.own_ms):
                tally.own_ms.append(read.own_ms)
    return {
        "completed": tally.completed,
        "refused": tally.refused,
        "failures": tally.failures,
        "expected_events": direct.events,
        "ttft_ms": tally.ttft_ms,
        "written_ms": tally.written_ms,
        "transit_ms": tally.transit_ms,
        "direct_transit_ms": direct_transit,
        "own_ms": tally.own_ms,
        "connect_ms": tally.connect_ms,
        "head_ms": tally.head_ms,
        "seconds": time.perf_counter() - started,
    }


def main() -> None:
    cli = argparse.ArgumentParser(prog="bench_streams", description="Open many streams at once; JSON in a file.")
    cli.add_argument("--port", type=int, required=True)
    cli.add_argument("--reference-port", type=int, required=True)
    cli.add_argument("--streams", type=int, required=True)
    cli.add_argument("--open-seconds", type=float, required=True)
    cli.add_argument("--ttft-ms", type=float, required=True)
    cli.add_argument("--report", type=Path, required=True, help="where to write the figures (JSON)")
    args = cli.parse_args()
    raise_fd_limit(2 * args.streams + 1024)
    import uvloop

    args.report.write_bytes(orjson.dumps(uvloop.run(load(args))))


if __name__ == "__main__":
    main()
