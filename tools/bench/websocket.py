"""`sluice bench --scenario websocket`: the Responses API over WebSocket against the same over HTTP, side by side.

The upstream is the test suite's fake OpenAI (tests/support/openai_socket.py, run from the checkout as a process
of its own): the Responses API over HTTP/SSE and over OpenAI's WebSocket mode, first token after 20 ms, then 8
tokens 1 ms apart. One `sluice serve` (one worker, no plugins) has it twice as an `openai`-type backend: model
`pinned` with `websocket: auto` (a client socket's turns go over an upstream socket pinned to it) and model
`bridged` with `websocket: off` (every turn over the HTTP pool). Every turn is a streamed Responses create; the
client reads it to its terminal event.

- Per turn: five sides interleaved turn by turn, their order rotated: `direct http` (HTTP straight to the
  upstream), `direct websocket` (a socket straight to it), `http` (HTTP through the gateway), `websocket bridged`
  and `websocket pinned` (a socket to the gateway, the turn upstream over HTTP or over the pinned socket). Time to
  the first output delta and to `response.completed` at the client, p50 and p99, and each side's p50 less its
  direct counterpart's (HTTP for the HTTP and bridged sides, the socket for the pinned one): what the gateway adds.
- The loop: a scripted conversation of 20 turns, each sending only its new input (a tool's output, as an agent
  does) with `previous_response_id`, over HTTP (the upstream is handed the id and finds it in its store), over a
  bridged socket (the gateway expands it from the socket's memory) and over a pinned one (the id goes up the
  pinned socket, whose upstream holds the response), rotated; wall time of a whole loop, p50, and the gateway's
  CPU per turn read from /proc during each side's loops.

The HTTP client is httpx with keep-alive (as the SDK), the WebSocket one the `websockets` package (the SDK's);
both run in this process, on the same event loop.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

from gateway.telemetry.quantiles import percentile
from tools.llamacpp.server import free_port

TTFT_MS, TPOT_MS, TOKENS = 20, 1, 8
TURN_SAMPLES = 300
LOOP_TURNS = 20
LOOPS = 10
CLK_TCK = os.sysconf("SC_CLK_TCK")
# The fake OpenAI upstream is the test suite's: the bench runs it from the checkout (it is not installed).
CHECKOUT = Path(__file__).resolve().parents[2]
FAKE = CHECKOUT / "tests" / "support" / "openai_socket.py"
ENDS = (b"response.completed", b"response.incomplete", b"response.failed")


def cpu_seconds(pid: int) -> float:
    data = Path(f"/proc/{pid}/stat").read_bytes()
    fields = data[data.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def start(command: list[str], url: str, log: Path, cwd: Path | None = None) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=out, cwd=cwd)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{' '.join(command[2:4])} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"{' '.join(command[2:4])} did not start: {log.read_text()[-2000:]}")


Run = Callable[[dict[str, Any]], Awaitable[tuple[float, float, str]]]


class Sides:
    """The ways to run one turn; each returns (ms to the first delta, ms to the end, the response id)."""

    def __init__(self, upstream: str, gateway: str, client: httpx.AsyncClient, sockets: dict[str, Any]) -> None:
        self.upstream = upstream
        self.gateway = gateway
        self.client = client
        self.sockets = sockets  # "direct", "bridged", "pinned"

    async def http(self, base: str, body: dict[str, Any]) -> tuple[float, float, str]:
        started = time.perf_counter()
        first = 0.0
        ident = ""
        async with self.client.stream("POST", f"{base}/v1/responses", json={**body, "stream": True}) as response:
            async for line in response.aiter_lines():
                if not first and "output_text.delta" in line:
                    first = time.perf_counter()
                if line.startswith("data:") and any(end.decode() in line[:80] for end in ENDS):
                    ident = orjson.loads(line[5:])["response"]["id"]
        end = time.perf_counter()
        return (first - started) * 1000.0, (end - started) * 1000.0, ident

    async def direct(self, body: dict[str, Any]) -> tuple[float, float, str]:
        return await self.http(self.upstream, body)

    async def through(self, body: dict[str, Any]) -> tuple[float, float, str]:
        return await self.http(self.gateway, {**body, "model": "bridged"})

    async def direct_socket(self, body: dict[str, Any]) -> tuple[float, float, str]:
        return await self.websocket(self.sockets["direct"], body)

    async def bridged(self, body: dict[str, Any]) -> tuple[float, float, str]:
        return await self.websocket(self.sockets["bridged"], {**body, "model": "bridged"})

    async def pinned(self, body: dict[str, Any]) -> tuple[float, float, str]:
        return await self.websocket(self.sockets["pinned"], {**body, "model": "pinned"})

    async def websocket(self, socket: Any, body: dict[str, Any]) -> tuple[float, float, str]:
        started = time.perf_counter()
        first = 0.0
        await socket.send(orjson.dumps({"type": "response.create", **body}).decode())
        while True:
            message = await socket.recv()
            head = message[:60]
            if not first and "output_text.delta" in head:
                first = time.perf_counter()
            if '"error"' in head:
                raise RuntimeError(f"the socket answered an error: {message[:300]}")
            if any(end.decode() in head for end in ENDS):
                ident: str = orjson.loads(message)["response"]["id"]
                end = time.perf_counter()
                return (first - started) * 1000.0, (end - started) * 1000.0, ident


def summary(values: list[float]) -> str:
    ordered = sorted(values)
    return f"{percentile(ordered, 0.5):.2f} / {percentile(ordered, 0.99):.2f}"


async def per_turn(sides: Sides, samples: int, gateway_pid: int) -> list[str]:
    runs: dict[str, Run] = {
        "direct http": sides.direct,
        "direct websocket": sides.direct_socket,
        "http": sides.through,
        "websocket bridged": sides.bridged,
        "websocket pinned": sides.pinned,
    }
    baseline = {"http": "direct http", "websocket bridged": "direct http", "websocket pinned": "direct websocket"}
    names = list(runs)
    ttft: dict[str, list[float]] = {name: [] for name in names}
    total: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, float] = dict.fromkeys(names, 0.0)  # the gateway's, summed over each side's turns
    for i in range(samples + 20):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            before = cpu_seconds(gateway_pid)
            first, end, _ = await runs[name]({"model": "fake", "input": f"turn {i}: say ok", "store": False})
            if i >= 20:  # the first rounds warm every path
                ttft[name].append(first)
                total[name].append(end)
                cpu[name] += cpu_seconds(gateway_pid) - before
    lines = [
        "| side | TTFT p50 / p99 (ms) | total p50 / p99 (ms) | added TTFT p50 (ms) | added total p50 (ms) "
        "| gateway CPU per turn (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        base = baseline.get(name)
        if base is None:
            added, used = "| - | - ", "-"
        else:
            added_ttft = statistics.median(ttft[name]) - statistics.median(ttft[base])
            added_total = statistics.median(total[name]) - statistics.median(total[base])
            added, used = f"| {added_ttft:+.2f} | {added_total:+.2f} ", f"{cpu[name] * 1000.0 / samples:.2f}"
        lines.append(f"| {name} | {summary(ttft[name])} | {summary(total[name])} {added}| {used} |")
    return lines


async def loop(sides: Sides, run: Run, n: int) -> float:
    started = time.perf_counter()
    previous: str | None = None
    tool = "x" * 400  # a tool's output: what each turn of an agent sends
    for turn in range(LOOP_TURNS):
        body: dict[str, Any] = {"model": "fake", "input": [{"role": "user", "content": f"loop {n} step {turn} {tool}"}]}
        if previous is not None:
            body["previous_response_id"] = previous
        _, _, previous = await run(body)
    return (time.perf_counter() - started) * 1000.0


async def loops(sides: Sides, gateway_pid: int, count: int) -> list[str]:
    runs: dict[str, Run] = {"http": sides.through, "websocket bridged": sides.bridged, "websocket pinned": sides.pinned}
    walls: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, float] = dict.fromkeys(runs, 0.0)
    names = list(runs)
    for n in range(count + 1):
        for name in names[n % 3 :] + names[: n % 3]:
            run = runs[name]
            before = cpu_seconds(gateway_pid)
            wall = await loop(sides, run, n)
            if n:  # the first loop of each warms it
                walls[name].append(wall)
                cpu[name] += cpu_seconds(gateway_pid) - before
    lines = [
        f"| {LOOP_TURNS}-turn loop | wall p50 (ms) | wall min (ms) | gateway CPU per turn (ms) |",
        "|---|---|---|---|",
    ]
    for name in walls:
        per_turn_cpu = cpu[name] * 1000.0 / (count * LOOP_TURNS)
        lines.append(f"| {name} | {statistics.median(walls[name]):.1f} | {min(walls[name]):.1f} | {per_turn_cpu:.2f} |")
    return lines


async def measure(upstream: str, gateway: str, gateway_pid: int, samples: int, count: int) -> list[str]:
    from websockets.asyncio.client import connect

    limits = httpx.Limits(max_keepalive_connections=4)
    to_gateway = gateway.replace("http", "ws", 1) + "/v1/responses"
    options: dict[str, Any] = {"max_size": None, "compression": None}
    async with (
        httpx.AsyncClient(limits=limits, timeout=30) as client,
        connect(upstream.replace("http", "ws", 1) + "/v1/responses", **options) as direct,
        connect(to_gateway, **options) as bridged,
        connect(to_gateway, **options) as pinned,
    ):
        sides = Sides(upstream, gateway, client, {"direct": direct, "bridged": bridged, "pinned": pinned})
        before = (await client.get(f"{upstream}/stats")).json()
        lines = [*await per_turn(sides, samples, gateway_pid), "", *await loops(sides, gateway_pid, count)]
        after = (await client.get(f"{upstream}/stats")).json()
    # How the turns reached the upstream: the pinned side's over the one socket the gateway opened for its client
    # socket (the first of them over HTTP while it opened), the others over HTTP; the direct socket was open before.
    lines += [
        "",
        f"- Upstream, during the run: {after['sockets'] - before['sockets']} socket(s) opened by the gateway; "
        f"{after['socket_creates'] - before['socket_creates']} creates over sockets (the direct and pinned sides'), "
        f"{after['posts'] - before['posts']} over HTTP.",
    ]
    return lines


def main(preset: str = "default", write: str | None = None) -> int:
    try:
        import websockets  # noqa: F401
    except ImportError:
        print("sluice bench: the websocket scenario needs the websockets package (pip install websockets)")
        return 2
    if not FAKE.exists():
        print(f"sluice bench: the websocket scenario runs the fake OpenAI upstream of a checkout ({FAKE}): not found")
        return 2
    samples = {"smoke": 20, "quick": 100}.get(preset, TURN_SAMPLES)
    count = {"smoke": 1, "quick": 4}.get(preset, LOOPS)
    with tempfile.TemporaryDirectory(prefix="sluice-bench-ws-") as tmp:
        work = Path(tmp)
        sim_port, gateway_port = free_port(), free_port()
        sim_url, gateway_url = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{gateway_port}"
        sim_command = [sys.executable, "-m", "tests.support.openai_socket", "--port", str(sim_port)]
        sim_command += ["--ttft-ms", str(TTFT_MS), "--tpot-ms", str(TPOT_MS), "--tokens", str(TOKENS)]
        config = work / "gateway.yaml"
        config.write_text(
            "backends:\n"
            f"  pinned: {{type: openai, base_url: '{sim_url}/v1', api_key: unused}}\n"
            f"  bridged: {{type: openai, base_url: '{sim_url}/v1', api_key: unused, websocket: 'off'}}\n"
            "pool: {warm_connections: 4}\nmodels:\n  pinned: {backend: pinned}\n  bridged: {backend: bridged}\n"
        )
        serve = [sys.executable, "-m", "gateway.cli", "serve", "-c", str(config), "--port", str(gateway_port)]
        sim = start(sim_command, f"{sim_url}/v1/models", work / "upstream.log", cwd=CHECKOUT)
        try:
            gateway = start([*serve, "--log-level", "warning"], f"{gateway_url}/readyz", work / "gateway.log")
            try:
                lines = asyncio.run(measure(sim_url, gateway_url, gateway.pid, samples, count))
            finally:
                gateway.terminate()
                gateway.wait(30)
        finally:
            sim.terminate()
            sim.wait(30)
    head = [
        "## Responses API over WebSocket",
        "",
        f"Fake OpenAI upstream (HTTP/SSE and WebSocket mode): first token {TTFT_MS} ms, {TOKENS} tokens {TPOT_MS} ms",
        f"apart; one gateway worker, no plugins. Per turn: {samples} turns per side, interleaved; the loop: {count}",
        "loops per side, rotated.",
        "",
    ]
    text = "\n".join([*head, *lines]) + "\n"
    print(text, end="")
    if write:
        Path(write).write_text(text)
    return 0
