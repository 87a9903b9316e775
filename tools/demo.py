"""`sluice demo`: the gateway's SLO fallback, cache and overhead, live, in under a minute, on loopback only.

One process on uvloop holds everything: two simulated upstreams ("large", slow to start but the primary;
"small", quick, the fallback), the real gateway under uvicorn with the cache and slo plugins, and a closed
loop of streaming clients. A timeline slows "large" down and later lets it recover, so the SLO plugin
degrades chat-large to chat-small and returns to it; a quarter of the requests repeat a few prompts at
temperature 0, so the cache answers them. Every second a line shows what the clients measured and what the
gateway said in its response headers; a summary closes the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import socket
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TextIO, cast

import httpx
import uvicorn

from gateway.app import SERVER_OPTIONS, Gateway, create_app
from gateway.config import parse
from gateway.simulation.answers import Profile
from gateway.telemetry.quantiles import percentile
from tools.sim import server as sim

LARGE = Profile(ttft_ms=250.0, tpot_ms=10.0, tokens=16)
OVERLOADED = Profile(ttft_ms=1500.0, tpot_ms=10.0, tokens=16)
SMALL = Profile(ttft_ms=60.0, tpot_ms=5.0, tokens=16)
SLO_TTFT_P95_MS = 600
CONFIG = """
backends:
  large: {{type: vllm, base_url: "http://127.0.0.1:{large}/v1"}}
  small: {{type: vllm, base_url: "http://127.0.0.1:{small}/v1"}}
models:
  chat-large:
    backend: large
    fallback: [chat-small]
    slo: {{ttft_p95_ms: {slo}, window_s: 5, min_samples: 8, probe_ratio: 0.1, cooldown_s: 4, recovery_samples: 3}}
  chat-small: {{backend: small}}
plugins: [cache, slo]
"""
REPEATED = ("What does a sluice do?", "Name three rivers.", "Why is the sea salty?", "Say hello.")
MIN_DURATION_S = 15.0  # below this, detection, the cool-down and the recovery probes do not fit in the run
TICK_S = 0.1
STOP_TIMEOUT_S = 8.0


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    starts: float  # share of the run's duration
    profile: Profile  # what "large" does from then on
    note: str


PHASES = (
    Phase("warm", 0.0, LARGE, "chat-large answers at its usual speed (TTFT ~250 ms)"),
    Phase(
        "large overloaded",
        0.25,
        OVERLOADED,
        f"chat-large's TTFT jumps to ~1500 ms, over its SLO (p95 <= {SLO_TTFT_P95_MS} ms)",
    ),
    Phase("large recovered", 0.6, LARGE, "chat-large is fast again; the gateway probes it before trusting it"),
)


@dataclass(frozen=True, slots=True)
class Plan:
    duration_s: float = 45.0
    concurrency: int = 8
    port: int = 0  # the gateway's; 0 picks a free one


@dataclass(frozen=True, slots=True)
class Sample:
    """One finished request, as the client saw it."""

    phase: int  # the phase it started in
    ttft_ms: float | None  # to the first content chunk
    served: str  # x-sluice-model
    fallback: str | None  # x-sluice-fallback
    cached: bool  # x-sluice-cache: hit
    overhead_ms: float | None  # x-sluice-overhead-ms
    ok: bool  # 200 and a stream that reached [DONE] without an error event


class SloView(Protocol):
    def states(self) -> dict[str, str]: ...


class CacheView(Protocol):
    stats: dict[str, int]


class DemoError(Exception):
    """The demo could not start (a port taken, the gateway not ready)."""


class Upstream:
    """A simulated model server on loopback whose speed can change while it runs, as an overloaded one does.

    The profile is changed on the running server's shared state, because a slowdown has to reach the
    connections the gateway already holds: closing a listening server and starting another on the same port
    leaves those keep-alive connections, and the old profile, in place.
    """

    def __init__(self, profile: Profile) -> None:
        self.state = sim.State(profile)
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await sim.start_server("127.0.0.1", 0, self.state.profile, state=self.state)
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    def use(self, profile: Profile) -> None:
        """Answer every request from now on with `profile`; answers already under way keep theirs."""
        self.state.profile = profile

    async def aclose(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


class EmbeddedServer(uvicorn.Server):
    """uvicorn in a loop the demo owns: Ctrl-C goes to the demo, which then stops the server itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Run:
    """What one demo run has seen so far, and where it writes."""

    def __init__(self, plan: Plan, out: TextIO) -> None:
        self.plan = plan
        self.out = out
        self.colour = out.isatty() and "NO_COLOR" not in os.environ
        self.started = time.perf_counter()
        self.samples: list[Sample] = []
        self.requests = 0
        self.phase = 0
        self.phase_started = [0.0]
        self.state = "healthy"
        self.transitions: list[tuple[float, str]] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def say(self, line: str = "") -> None:
        self.out.write(line + "\n")
        self.out.flush()

    def enter(self, index: int) -> None:
        if index:
            self.phase = index
            self.phase_started.append(self.elapsed())
        phase = PHASES[index]
        self.say(f"\n==> {self.elapsed():4.1f}s  {phase.name}: {phase.note}")
        self.say(HEADER)

    def saw(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.transitions.append((self.elapsed(), state))


class Echo(logging.Handler):
    """The gateway's warnings (the SLO plugin's transitions among them), written in the demo's stream
    rather than on stderr, where they would tear through the table."""

    def __init__(self, run: Run) -> None:
        super().__init__(logging.WARNING)
        self.run = run

    def emit(self, record: logging.LogRecord) -> None:
        self.run.say(f"{self.run.elapsed():5.1f}s  ! {record.getMessage()}")


# The load: closed-loop streaming clients


def request_body(number: int) -> dict[str, Any]:
    # Every fourth request repeats a prompt at temperature 0: deterministic, so the cache may answer it.
    if number % 4 == 0:
        prompt, temperature = REPEATED[(number // 4) % len(REPEATED)], 0.0
    else:
        prompt, temperature = f"Request {number}: tell me about the river.", 0.7
    messages = [{"role": "user", "content": prompt}]
    return {"model": "chat-large", "messages": messages, "stream": True, "temperature": temperature}


async def exchange(http: httpx.AsyncClient, body: dict[str, Any], phase: int) -> Sample:
    started = time.perf_counter()
    ttft_ms: float | None = None
    ok = False
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            # The first event only carries the role (content ""): the first token comes after it.
            if ttft_ms is None and '"content":"' in line and '"content":""' not in line:
                ttft_ms = (time.perf_counter() - started) * 1000.0
            elif line.startswith('data: {"error"'):
                break
            elif line == "data: [DONE]":
                ok = response.status_code == 200
        headers = response.headers
    overhead = headers.get("x-sluice-overhead-ms")
    return Sample(
        phase=phase,
        ttft_ms=ttft_ms,
        served=headers.get("x-sluice-model", "?"),
        fallback=headers.get("x-sluice-fallback"),
        cached=headers.get("x-sluice-cache") == "hit",
        overhead_ms=float(overhead) if overhead else None,
        ok=ok,
    )


async def client(run: Run, http: httpx.AsyncClient) -> None:
    while True:
        run.requests += 1
        body = request_body(run.requests)
        try:
            sample = await exchange(http, body, run.phase)
        except httpx.HTTPError:
            sample = Sample(run.phase, None, "?", None, False, None, ok=False)
            await asyncio.sleep(0.1)  # the gateway is going away: no busy loop of failures
        run.samples.append(sample)


# The story: the timeline, the per-second lines, the SLO state


async def timeline(run: Run, large: Upstream) -> None:
    for index, phase in enumerate(PHASES):
        await asyncio.sleep(max(0.0, phase.starts * run.plan.duration_s - run.elapsed()))
        large.use(phase.profile)
        run.enter(index)
    # A hair past the end, so that the line of the last second is printed before the load stops.
    await asyncio.sleep(max(0.0, run.plan.duration_s + TICK_S / 2 - run.elapsed()))


async def monitor(run: Run, slo: SloView) -> None:
    """Watch the SLO state every tick (transition times to the tenth of a second); one line each second."""
    shown = 0
    last = run.elapsed()
    mark = math.floor(last) + 1.0
    while True:
        await asyncio.sleep(min(TICK_S, max(0.0, mark - run.elapsed())))
        run.saw(slo.states().get("chat-large", "?"))
        now = run.elapsed()
        if now >= mark:
            batch = run.samples[shown:]
            shown += len(batch)
            run.say(row(mark, now - last, batch, run.state, run.colour))
            last, mark = now, math.floor(now) + 1.0


HEADER = (
    f"{'time':>6} {'req/s':>6} {'TTFT p50':>9} {'p95':>8} {'large':>6} {'small':>6}  {'fallback':<10}"
    f" {'cached':>6} {'overhead':>9}  chat-large SLO"
)


def row(at: float, interval: float, batch: list[Sample], state: str, colour: bool) -> str:
    ttfts = [s.ttft_ms for s in batch if s.ttft_ms is not None]
    upstream = [s for s in batch if not s.cached]  # who served, as routed now (a hit replays an older answer)
    served = Counter(s.served for s in upstream)
    reasons = Counter(s.fallback for s in upstream if s.fallback)
    overheads = [s.overhead_ms for s in batch if s.overhead_ms is not None]
    failed = sum(not s.ok for s in batch)
    text = (
        f"{at:5.0f}s {len(batch) / interval:6.1f} {ms(percentile(ttfts, 0.5)):>9} {ms(percentile(ttfts, 0.95)):>8}"
        f" {served['chat-large']:>6} {served['chat-small']:>6}  {counts(reasons.most_common()):<10}"
        f" {sum(s.cached for s in batch):>6} {ms(percentile(overheads, 0.5), 2):>9}  {paint(state, colour)}"
    )
    return text + (f"  ({failed} failed)" if failed else "")


def paint(state: str, colour: bool) -> str:
    if not colour:
        return state
    code = "32" if state == "healthy" else "1;31"
    return f"\033[{code}m{state}\033[0m"


def ms(value: float | None, digits: int = 0) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f} ms"


# The summary


def summary(run: Run, cache: CacheView) -> tuple[list[str], bool]:
    """The closing lines, and whether the run showed what it is for (degradation, recovery, cache hits)."""
    lines = ["", "Summary", "  " + story(run)]
    lines.append(f"  {'TTFT p50 by phase':<24}{'clients saw':>12}{'chat-large alone':>18}   (upstream answers)")
    for index, phase in enumerate(PHASES[: len(run.phase_started)]):
        answers = [s for s in run.samples if s.phase == index and not s.cached and s.ttft_ms is not None]
        large = [s.ttft_ms for s in answers if s.served == "chat-large" and s.ttft_ms is not None]
        seen = ms(percentile([s.ttft_ms for s in answers if s.ttft_ms is not None], 0.5))
        lines.append(f"    {phase.name:<20}{seen:>12}{ms(percentile(large, 0.5)):>18}")
    lines.append('  ("chat-large alone" is what every client would have waited without the fallback.)')
    total = len(run.samples)
    hits = [s for s in run.samples if s.cached]
    hit_ttfts = [s.ttft_ms for s in hits if s.ttft_ms is not None]
    lines.append(
        f"  cache: {len(hits)} hits of {total} requests ({len(hits) / max(total, 1):.0%}), TTFT p50 "
        f"{ms(percentile(hit_ttfts, 0.5), 1)}; plugin counts: {counts(cache.stats.items())}"
    )
    overheads = [s.overhead_ms for s in run.samples if s.overhead_ms is not None]
    # Only the median: the clients share this process and its loop, so the gateway's tail here is partly
    # theirs; `sluice bench` measures the tail with the gateway on its own.
    lines.append(
        f"  gateway overhead p50 {ms(percentile(overheads, 0.5), 2)} (x-sluice-overhead-ms; for the tail, "
        "see `sluice bench`)"
    )
    failed = sum(not s.ok for s in run.samples)
    lines.append(f"  failed requests: {failed}")
    states = [state for _, state in run.transitions]
    shown = "degraded" in states and states[-1] == "healthy" and bool(hits)
    return lines, shown


def story(run: Run) -> str:
    degraded = next((t for t, state in run.transitions if state == "degraded"), None)
    if degraded is None:
        return "chat-large did not degrade."
    recovered = next((t for t, state in run.transitions if state == "healthy" and t > degraded), None)
    text = f"chat-large degraded at t={degraded:.1f}s"
    if len(run.phase_started) > 1:
        text += f" ({degraded - run.phase_started[1]:.1f} s after the overload began)"
    if recovered is None:
        return text + " and was still degraded at the end."
    text += f" and recovered at t={recovered:.1f}s"
    if len(run.phase_started) > 2:
        text += f" ({recovered - run.phase_started[2]:.1f} s after the upstream did)"
    return text + "."


def counts(pairs: Iterable[tuple[str, int]]) -> str:
    return ", ".join(f"{name} {count}" for name, count in pairs) or "-"


# Start-up and shutdown


def listen(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
    except OSError as exc:
        sock.close()
        raise DemoError(f"cannot listen on 127.0.0.1:{port}: {exc.strerror}") from exc
    return sock


async def start_gateway(config: str, sock: socket.socket) -> tuple[EmbeddedServer, asyncio.Task[None], Gateway]:
    app = create_app(parse(config, "<demo config>"))
    server = EmbeddedServer(
        uvicorn.Config(
            app,
            loop="none",  # the demo's loop is already running (uvloop)
            log_level="warning",
            **SERVER_OPTIONS,  # type: ignore[arg-type]
            timeout_graceful_shutdown=2,
        )
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    deadline = time.monotonic() + 10.0
    while not server.started:
        if task.done() or time.monotonic() > deadline:
            await stop_gateway(server, task)
            raise DemoError("the gateway did not start")
        await asyncio.sleep(0.02)
    return server, task, app


async def stop_gateway(server: EmbeddedServer, task: asyncio.Task[None]) -> None:
    server.should_exit = True
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), STOP_TIMEOUT_S)
    if not task.done():
        server.force_exit = True
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def wait_ready(http: httpx.AsyncClient) -> None:
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if (await http.get("/readyz")).status_code == 200:
                return
        await asyncio.sleep(0.05)
    raise DemoError("the gateway did not become ready")


def plugin(app: Gateway, name: str) -> object:
    assert app.runtime is not None
    for candidate in app.runtime.plugins:
        if candidate.name == name:
            return candidate
    raise DemoError(f"the {name} plugin is not loaded")


def intro(run: Run, gateway_port: int, ports: tuple[int, int]) -> None:
    plan = run.plan
    marks = ", ".join(f"{phase.starts * plan.duration_s:.0f} s {phase.name}" for phase in PHASES)
    run.say(
        f"sluice demo: {plan.duration_s:.0f} s, {plan.concurrency} streaming clients on chat-large, "
        f"gateway at http://127.0.0.1:{gateway_port}/v1"
    )
    run.say(
        f"  chat-large -> simulated 'large' on :{ports[0]} (TTFT ~250 ms), "
        f"SLO p95 TTFT <= {SLO_TTFT_P95_MS} ms, fallback chat-small"
    )
    run.say(f"  chat-small -> simulated 'small' on :{ports[1]} (TTFT ~60 ms)")
    run.say("  a quarter of the requests repeat a few prompts at temperature 0, so the cache can answer them")
    run.say(f"  timeline: {marks}, end at {plan.duration_s:.0f} s")
    run.say("  each line is the last second: requests/s, TTFT seen by the clients, upstream answers by model,")
    run.say("  fallback reasons, cache hits, the gateway's own overhead (p50) and chat-large's SLO state")


async def play(run: Run, gateway_port: int, ports: tuple[int, int], large: Upstream, slo: SloView) -> bool:
    """The load and the timeline until the end, or until a cancellation (Ctrl-C): then True.

    Every task it started has finished when it returns.
    """
    limits = httpx.Limits(max_connections=run.plan.concurrency, max_keepalive_connections=run.plan.concurrency)
    base_url = f"http://127.0.0.1:{gateway_port}"
    async with httpx.AsyncClient(base_url=base_url, timeout=30.0, limits=limits) as http:
        await wait_ready(http)
        intro(run, gateway_port, ports)
        run.started = time.perf_counter()  # the timeline counts from the first request, not from start-up
        tasks = [asyncio.create_task(client(run, http)) for _ in range(run.plan.concurrency)]
        tasks.append(asyncio.create_task(monitor(run, slo)))
        try:
            await timeline(run, large)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.uncancel() > 0:
                raise  # cancelled more than once: not a single Ctrl-C but a request to stop at once
            run.say(f"\n{run.elapsed():5.1f}s  interrupted: shutting down")
            return True
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return False


async def run_demo(plan: Plan, out: TextIO) -> int:
    """Run the whole demo; 0 when it showed degradation, recovery and cache hits, 1 when not, 130 on Ctrl-C.

    Ctrl-C (a cancellation under `asyncio.run`) ends the load early; the summary of what ran is still printed.
    """
    run = Run(plan, out)
    large, small = Upstream(LARGE), Upstream(SMALL)
    async with contextlib.AsyncExitStack() as stack:
        logger = logging.getLogger("sluice")
        echo = Echo(run)
        logger.addHandler(echo)
        stack.callback(logger.removeHandler, echo)
        stack.push_async_callback(large.aclose)
        stack.push_async_callback(small.aclose)
        ports = (await large.start(), await small.start())
        sock = listen(plan.port)
        stack.callback(sock.close)
        gateway_port: int = sock.getsockname()[1]
        config = CONFIG.format(large=ports[0], small=ports[1], slo=SLO_TTFT_P95_MS)
        server, task, app = await start_gateway(config, sock)
        stack.push_async_callback(stop_gateway, server, task)
        slo, cache = cast(SloView, plugin(app, "slo")), cast(CacheView, plugin(app, "cache"))
        interrupted = await play(run, gateway_port, ports, large, slo)
        lines, shown = summary(run, cache)
    for line in lines:
        run.say(line)
    if interrupted:
        return 130
    return 0 if shown else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=45.0, help="seconds of load (default 45, at least 15)")
    parser.add_argument("--concurrency", type=int, default=8, help="streaming clients in a closed loop (default 8)")
    parser.add_argument("--port", type=int, default=0, help="the gateway's port on 127.0.0.1 (default: a free one)")


def main(args: argparse.Namespace) -> int:
    """Run the demo on uvloop, printing to stdout; the exit code of `run_demo`, 2 on bad arguments."""
    if args.duration < MIN_DURATION_S or args.concurrency < 1 or not 0 <= args.port <= 65535:
        print(
            f"sluice demo: --duration must be at least {MIN_DURATION_S:.0f}, --concurrency at least 1, "
            "--port from 0 to 65535",
            file=sys.stderr,
        )
        return 2
    import uvloop

    plan = Plan(duration_s=args.duration, concurrency=args.concurrency, port=args.port)
    try:
        code: int = uvloop.run(run_demo(plan, sys.stdout))
    except DemoError as exc:
        print(f"sluice demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        return 130
    return code


if __name__ == "__main__":
    cli = argparse.ArgumentParser(prog="sluice demo", description="SLO fallback, cache and overhead, live.")
    add_arguments(cli)
    sys.exit(main(cli.parse_args()))
