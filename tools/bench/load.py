"""The load generator of `sluice bench`: request bodies, one timed request, open and closed loops.

It is `gateway.upstream.pool.Pool` on uvloop: a general-purpose client costs more per request than the gateway does
and would hide it. Each response's timing and the gateway's own headers (`x-sluice-overhead-ms`,
`server-timing`, `x-sluice-cache`) go to a `Samples`; figures are made from those later, off the clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

from gateway.upstream.connection import PoolError
from gateway.upstream.pool import Pool, PoolLimits
from gateway.wire.marks import FIRST_TOKEN
from tools.bench.fleet import BenchError, Child

JSON_HEADERS = b"content-type: application/json\r\n"
OVERHEAD_HEADER = b"x-sluice-overhead-ms"
TIMING_HEADER = b"server-timing"
CACHE_HEADER = b"x-sluice-cache"
# Streams use /v1/completions because its first event is the first token, written the moment the request
# arrives. A chat stream opens with a role-only event and its first token waits on the upstream's
# millisecond-granular timer, which would round away part of the gateway's request path.
STREAM_PATH = b"/v1/completions"
PLAIN_PATH = b"/v1/chat/completions"
PROMPTS = ("Tell me about rivers.", "Say something calm.", "Describe the sea.", "Name a colour.")
CLIENT_LIMITS = PoolLimits(
    max_connections=1024,
    max_idle=1024,
    warm=0,
    pool_timeout=30.0,
    first_byte_timeout=30.0,
    idle_read_timeout=30.0,
    keepalive_expiry=3600.0,
)
# (gateway CPU seconds, seconds its CPU was busy with anything, load generator + helpers CPU seconds)
Meters = Callable[[], tuple[float, float, float]]


@dataclass(frozen=True, slots=True)
class Workload:
    path: bytes
    bodies: tuple[bytes, ...]
    stream: bool
    headers: bytes = JSON_HEADERS
    method: bytes = b"POST"
    answer: re.Pattern[bytes] = FIRST_TOKEN  # what a good answer (a stream: a chunk) holds; its first one is timed
    # Header lines of each request's own, added to `headers` (request i gets extra[i % len]), e.g. a traceparent.
    extra: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class Lane:
    """One target of an interleaved open loop: where the requests go, what they are, what warms it first."""

    pool: Pool
    work: Workload
    warm: Workload


@dataclass(slots=True)
class Samples:
    """One cell's measurements on one side (ms)."""

    latency: list[float] = field(default_factory=list)  # TTFT for streams, the whole exchange otherwise
    index: list[int] = field(default_factory=list)  # each latency's request number, to pair it across lanes
    gaps: list[float] = field(default_factory=list)  # between consecutive token chunks
    own: list[float] = field(default_factory=list)  # the gateway's x-sluice-overhead-ms
    timing: list[bytes] = field(default_factory=list)  # the gateway's server-timing, parsed later
    cache: dict[bytes, int] = field(default_factory=dict)  # x-sluice-cache value -> responses
    errors: int = 0


@dataclass(frozen=True, slots=True)
class Run:
    """One closed-loop run: its measured window only."""

    seconds: float
    requests: int
    gateway_cpu_s: float
    core_busy_s: float  # the gateway's CPU, busy with anything
    harness_cpu_s: float
    samples: Samples


def bodies(model: str, stream: bool, tokens: int, prompts: tuple[str, ...], temperature: float | None) -> Workload:
    extra = {} if temperature is None else {"temperature": temperature}
    if stream:
        made = [{"model": model, "prompt": p, "max_tokens": tokens, "stream": True, **extra} for p in prompts]
        return Workload(STREAM_PATH, tuple(orjson.dumps(b) for b in made), True)
    chats = [
        {"model": model, "messages": [{"role": "user", "content": p}], "max_tokens": tokens, **extra} for p in prompts
    ]
    return Workload(PLAIN_PATH, tuple(orjson.dumps(b) for b in chats), False)


def workload(
    model: str, stream: bool, tokens: int, headers: bytes = JSON_HEADERS, deterministic: bool = False
) -> Workload:
    """A few prompts, repeated: at temperature 0 (`deterministic`), each is answered from a cache once stored."""
    made = bodies(model, stream, tokens, PROMPTS, 0.0 if deterministic else None)
    return Workload(made.path, made.bodies, stream, headers)


def unique_workload(model: str, stream: bool, tokens: int, count: int, headers: bytes = JSON_HEADERS) -> Workload:
    """`count` prompts never sent before, at temperature 0: cacheable, and each one a miss the first time."""
    tag = uuid.uuid4().hex[:12]
    prompts = tuple(f"{PROMPTS[i % len(PROMPTS)]} ({tag}-{i})" for i in range(count))
    made = bodies(model, stream, tokens, prompts, 0.0)
    return Workload(made.path, made.bodies, stream, headers)


def health() -> Workload:
    """`GET /healthz`: a route outside the pipeline, the least a round trip to a gateway can cost."""
    return Workload(b"/healthz", (b"",), False, b"", b"GET", re.compile(rb'"status"'))


def record_headers(headers: list[tuple[bytes, bytes]], out: Samples) -> None:
    for name, value in headers:
        if name == OVERHEAD_HEADER:
            out.own.append(float(value))
        elif name == TIMING_HEADER:
            out.timing.append(value)
        elif name == CACHE_HEADER:
            out.cache[value] = out.cache.get(value, 0) + 1


async def once(pool: Pool, work: Workload, index: int, out: Samples) -> None:
    """One request; its figures go to `out`, a failure counts as an error."""
    body = work.bodies[index % len(work.bodies)]
    started = time.perf_counter()
    first = last = 0.0
    try:
        headers = work.headers + work.extra[index % len(work.extra)] if work.extra else work.headers
        response = await pool.request(work.method, work.path, headers, body)
        try:
            if work.stream:
                while chunk := await response.next_chunk():
                    if work.answer.search(chunk):
                        now = time.perf_counter()
                        if first:
                            out.gaps.append((now - last) * 1000.0)
                        else:
                            first = now
                        last = now
            else:
                first = time.perf_counter() if work.answer.search(await response.read()) else 0.0
        finally:
            response.close()
    except PoolError:
        out.errors += 1
        return
    if response.status != 200 or not first:
        out.errors += 1
        return
    out.latency.append((first - started) * 1000.0)
    out.index.append(index)
    record_headers(response.headers, out)


async def send_all(pool: Pool, work: Workload, concurrency: int) -> Samples:
    """Every body of `work` once, `concurrency` at a time (filling a cache, opening connections)."""
    out = Samples()
    indices = iter(range(len(work.bodies)))

    async def worker() -> None:
        for index in indices:
            await once(pool, work, index, out)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


async def prime(pool: Pool, work: Workload, concurrency: int) -> None:
    """Open and warm as many connections as a cell may need, on both hops, before it is timed."""
    scratch = Samples()
    await asyncio.gather(*(once(pool, work, i, scratch) for i in range(concurrency)))


async def open_loop(pool: Pool, work: Workload, rate: float, count: int, warm: Workload, concurrency: int) -> Samples:
    """`count` requests sent on a fixed schedule, whatever the answers do (no coordinated omission).

    `warm` primes the connections first: the same workload, or other bodies when this one's must stay unsent.
    """
    return (await interleaved([Lane(pool, work, warm)], rate, count, concurrency))[0]


async def interleaved(lanes: list[Lane], rate: float, count: int, concurrency: int) -> list[Samples]:
    """An open loop at `rate` per lane: slot after slot, one request per lane, evenly spaced.

    Lanes that share a schedule share the machine's state too (CPU idle states, caches, whatever else runs):
    what differs between their samples is the target, which is what a comparison between targets needs. The
    lanes' order changes from slot to slot (a fixed pseudo-random sequence), so that no lane always follows
    the same other one: a target's work after its answer (a cache store, a rate-limit correction) must not
    always land on the same neighbour.
    """
    for lane in lanes:
        await prime(lane.pool, lane.warm, concurrency)
    outs = [Samples() for _ in lanes]
    step = 1.0 / (rate * len(lanes))
    order = list(range(len(lanes)))
    shuffle = random.Random(len(lanes)).shuffle
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = []
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        for i in range(count):
            if len(order) > 1:
                shuffle(order)
            for position, j in enumerate(order):
                wait = start + (i * len(lanes) + position) * step - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                tasks.append(loop.create_task(once(lanes[j].pool, lanes[j].work, i, outs[j])))
        await asyncio.gather(*tasks)
    finally:
        gc.enable()
    return outs


async def closed_loop(
    pool: Pool, work: Workload, concurrency: int, warmup_s: float, seconds: float, meters: Meters
) -> Run:
    """`concurrency` connections each sending back to back; only the window after the warm-up counts."""
    out = Samples()
    stop = asyncio.Event()

    async def worker(index: int) -> None:
        while not stop.is_set():
            await once(pool, work, index, out)
            index += concurrency

    gc.collect()
    gc.disable()
    try:
        tasks = [asyncio.get_running_loop().create_task(worker(i)) for i in range(concurrency)]
        await asyncio.sleep(warmup_s)
        before = (time.perf_counter(), len(out.latency), *meters())
        await asyncio.sleep(seconds)
        after = (time.perf_counter(), len(out.latency), *meters())
        stop.set()
        await asyncio.gather(*tasks)
    finally:
        gc.enable()
    wall, requests, gateway, core, harness = (b - a for a, b in zip(before, after, strict=True))
    return Run(wall, round(requests), gateway, core, harness, out)


async def get(pool: Pool, path: bytes) -> tuple[int, bytes]:
    response = await pool.request(b"GET", path, b"", b"")
    try:
        return response.status, await response.read()
    finally:
        response.close()


async def wait_ready(child: Child, pool: Pool, path: bytes, deadline: float) -> None:
    while True:
        child.check_alive()
        with contextlib.suppress(PoolError):
            if (await get(pool, path))[0] == 200:
                return
        if time.monotonic() > deadline:
            raise BenchError(f"{child.name} not ready within the start-up timeout: {child.output()}")
        await asyncio.sleep(0.05)
