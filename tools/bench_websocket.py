"""`sluice bench --scenario websocket`: the Responses API over WebSocket against the same over HTTP, side by side.

One `sluice sim` upstream (first token after 20 ms, then 8 tokens 1 ms apart) and one `sluice serve` (one worker,
the simulated upstream as its `openai`-type backend, no plugins). Every turn is a streamed Responses create; the
client reads it to its terminal event.

- Per turn: three sides interleaved turn by turn, their order rotated: `direct` (HTTP straight to the sim),
  `http` (HTTP through the gateway) and `websocket` (a `response.create` on one open socket to the gateway). Time
  to the first output delta and to `response.completed` at the client, p50 and p99, and each side's p50 less
  direct's: what the gateway adds on each path.
- The loop: a scripted conversation of 20 turns, each sending only its new input (a tool's output, as an agent
  does) with `previous_response_id`, over HTTP (the upstream is handed the id) and over one socket (the gateway
  expands it from the socket's memory), alternated; wall time of a whole loop, p50, and the gateway's CPU per
  turn read from /proc during each side's loops.

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
from tools.llamacpp_server import free_port

TTFT_MS, TPOT_MS, TOKENS = 20, 1, 8
TURN_SAMPLES = 300
LOOP_TURNS = 20
LOOPS = 10
CLK_TCK = os.sysconf("SC_CLK_TCK")
ENDS = (b"response.completed", b"response.incomplete", b"response.failed")


def cpu_seconds(pid: int) -> float:
    data = Path(f"/proc/{pid}/stat").read_bytes()
    fields = data[data.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def start(command: list[str], url: str, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=out)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[3]} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"{command[3]} did not start: {log.read_text()[-2000:]}")


class Sides:
    """The three ways to run one turn; each returns (ms to the first delta, ms to the end, the response id)."""

    def __init__(self, sim: str, gateway: str, client: httpx.AsyncClient, socket: Any) -> None:
        self.sim = sim
        self.gateway = gateway
        self.client = client
        self.socket = socket

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
        return await self.http(self.sim, body)

    async def through(self, body: dict[str, Any]) -> tuple[float, float, str]:
        return await self.http(self.gateway, body)

    async def websocket(self, body: dict[str, Any]) -> tuple[float, float, str]:
        started = time.perf_counter()
        first = 0.0
        await self.socket.send(orjson.dumps({"type": "response.create", **body}).decode())
        while True:
            message = await self.socket.recv()
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
    runs: dict[str, Callable[[dict[str, Any]], Awaitable[tuple[float, float, str]]]] = {
        "direct": sides.direct,
        "http": sides.through,
        "websocket": sides.websocket,
    }
    names = list(runs)
    ttft: dict[str, list[float]] = {name: [] for name in names}
    total: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, float] = dict.fromkeys(names, 0.0)  # the gateway's, summed over each side's turns
    for i in range(samples + 20):
        order = names[i % 3 :] + names[: i % 3]
        for name in order:
            before = cpu_seconds(gateway_pid)
            first, end, _ = await runs[name]({"model": "sim", "input": f"turn {i}: say ok", "store": False})
            if i >= 20:  # the first rounds warm every path
                ttft[name].append(first)
                total[name].append(end)
                cpu[name] += cpu_seconds(gateway_pid) - before
    base_ttft = statistics.median(ttft["direct"])
    base_total = statistics.median(total["direct"])
    lines = [
        "| side | TTFT p50 / p99 (ms) | total p50 / p99 (ms) | added TTFT p50 (ms) | added total p50 (ms) "
        "| gateway CPU per turn (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        added_ttft = statistics.median(ttft[name]) - base_ttft
        added_total = statistics.median(total[name]) - base_total
        used = cpu[name] * 1000.0 / samples if name != "direct" else 0.0
        lines.append(
            f"| {name} | {summary(ttft[name])} | {summary(total[name])} | {added_ttft:+.2f} | {added_total:+.2f} "
            f"| {used:.2f} |"
        )
    return lines


async def loop(sides: Sides, run: Callable[[dict[str, Any]], Awaitable[tuple[float, float, str]]], n: int) -> float:
    started = time.perf_counter()
    previous: str | None = None
    tool = "x" * 400  # a tool's output: what each turn of an agent sends
    for turn in range(LOOP_TURNS):
        body: dict[str, Any] = {"model": "sim", "input": [{"role": "user", "content": f"loop {n} step {turn} {tool}"}]}
        if previous is not None:
            body["previous_response_id"] = previous
        _, _, previous = await run(body)
    return (time.perf_counter() - started) * 1000.0


async def loops(sides: Sides, gateway_pid: int, count: int) -> list[str]:
    walls: dict[str, list[float]] = {"http": [], "websocket": []}
    cpu: dict[str, float] = {"http": 0.0, "websocket": 0.0}
    for n in range(count + 1):
        for name, run in (("http", sides.through), ("websocket", sides.websocket)):
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


async def measure(sim: str, gateway: str, gateway_pid: int, samples: int, count: int) -> list[str]:
    from websockets.asyncio.client import connect

    limits = httpx.Limits(max_keepalive_connections=4)
    async with (
        httpx.AsyncClient(limits=limits, timeout=30) as client,
        connect(gateway.replace("http", "ws", 1) + "/v1/responses", max_size=None, compression=None) as socket,
    ):
        sides = Sides(sim, gateway, client, socket)
        return [*await per_turn(sides, samples, gateway_pid), "", *await loops(sides, gateway_pid, count)]


def main(preset: str = "default", write: str | None = None) -> int:
    try:
        import websockets  # noqa: F401
    except ImportError:
        print("sluice bench: the websocket scenario needs the websockets package (pip install websockets)")
        return 2
    samples = {"smoke": 20, "quick": 100}.get(preset, TURN_SAMPLES)
    count = {"smoke": 1, "quick": 4}.get(preset, LOOPS)
    with tempfile.TemporaryDirectory(prefix="sluice-bench-ws-") as tmp:
        work = Path(tmp)
        sim_port, gateway_port = free_port(), free_port()
        sim_url, gateway_url = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{gateway_port}"
        sim_command = [sys.executable, "-m", "gateway.cli", "sim", "--port", str(sim_port)]
        sim_command += ["--ttft-ms", str(TTFT_MS), "--tpot-ms", str(TPOT_MS), "--tokens", str(TOKENS)]
        config = work / "gateway.yaml"
        config.write_text(
            f"backends:\n  sim: {{type: openai, base_url: '{sim_url}/v1', api_key: unused}}\n"
            "pool: {warm_connections: 4}\nmodels:\n  sim: {backend: sim}\n"
        )
        serve = [sys.executable, "-m", "gateway.cli", "serve", "-c", str(config), "--port", str(gateway_port)]
        sim = start(sim_command, f"{sim_url}/v1/models", work / "sim.log")
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
        f"`sluice sim` upstream: first token {TTFT_MS} ms, {TOKENS} tokens {TPOT_MS} ms apart; one gateway worker,",
        f"no plugins. Per turn: {samples} turns per side, interleaved; the loop: {count} loops per side, alternated.",
        "",
    ]
    text = "\n".join([*head, *lines]) + "\n"
    print(text, end="")
    if write:
        Path(write).write_text(text)
    return 0
