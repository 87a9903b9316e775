"""`sluice bench --scenario real`: the routing and core measurements against real llama.cpp servers.

It needs the `llama-server` binary of tools/llamacpp/build.py (`python -m tools.llamacpp build`, ~6 min once) and the
`gguf` package (the test extras), and runs the tiny random-weight model of tools/llamacpp/model.py: the text is
gibberish, the prefill, decode and prompt cache are the server's own. Each server is started with `-n 24` (a
turn's answer: the model rarely ends one itself) and one thread, so that two replicas share the 2 cores.

- Routing: two replicas of four slots; the multi-turn chat workload of bench_routing (conversations sharing a
  system prompt, Poisson arrivals) through a `prefix` backend and then a `round_robin` one, each with its own
  system prompt so that neither starts with a cache the other warmed: TTFT p50/p99 at the client, the
  servers' cached share (`cached_tokens` / `prompt_tokens`) and requests per replica.
- Core: one server, one small cached prompt and one token, sent one at a time straight to the server and
  through the bare gateway, interleaved: TTFT p50/p99 of each side and their difference, the gateway's part.
"""

from __future__ import annotations

import asyncio
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from gateway.telemetry.quantiles import percentile
from tools.bench.routing import Phase, run_phase
from tools.llamacpp import build as llamacpp
from tools.llamacpp.model import TINY, ensure_model
from tools.llamacpp.server import LlamaServer, free_port

POLICIES = ("prefix", "round_robin")
REPLICAS = 2
SLOTS = 4
ANSWER_TOKENS = 24
RATE = 1.5  # turns/s offered: about half of what two 1-thread replicas of the tiny model serve
CORE_REQUESTS = 200


def gateway_config(urls: list[str]) -> str:
    endpoints = ", ".join(f'"{url}"' for url in urls)
    lines = ["backends:"]
    lines += [f"  {name}: {{type: llamacpp, endpoints: [{endpoints}], routing: {name}}}" for name in POLICIES]
    lines += ["pool: {warm_connections: 4}", "models:"]
    lines += [f"  {name}: {{backend: {name}}}" for name in POLICIES]
    return "\n".join(lines) + "\n"


def start_gateway(config: str, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    path = tmp / f"real-{port}.yaml"
    path.write_text(config)
    command = [sys.executable, "-m", "gateway.cli", "serve", "-c", str(path), "--port", str(port)]
    gateway = subprocess.Popen([*command, "--log-level", "error"])
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/readyz", timeout=1.0).status_code == 200:
                return gateway, base
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    gateway.kill()
    raise RuntimeError("the gateway did not become ready within 60 s")


def stop(gateway: subprocess.Popen[bytes]) -> None:
    gateway.send_signal(signal.SIGTERM)
    try:
        gateway.wait(15)
    except subprocess.TimeoutExpired:
        gateway.kill()
        gateway.wait()


def served(servers: list[LlamaServer]) -> list[float]:
    """Tokens each server has generated: a turn is ANSWER_TOKENS of them."""
    return [server.metrics()["tokens_predicted_total"] for server in servers]


def routing(build: llamacpp.Build, model: Path, tmp: Path, seconds: float) -> list[Phase]:
    with ExitStack() as stack:
        servers = [
            stack.enter_context(
                LlamaServer(build.binary, model, tmp, slots=SLOTS, threads=1, extra=("-n", str(ANSWER_TOKENS)))
            )
            for _ in range(REPLICAS)
        ]
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        gateway, base = start_gateway(gateway_config([server.base_url for server in servers]), tmp)
        try:
            phases = []
            for seed, policy in enumerate(POLICIES):
                before = served(servers)
                phase = asyncio.run(run_phase(base, policy, seconds, RATE, seed))
                after = served(servers)
                phase.per_replica = [round((a - b) / ANSWER_TOKENS) for a, b in zip(after, before, strict=True)]
                phases.append(phase)
            return phases
        finally:
            stop(gateway)


def timed(http: httpx.Client, url: str, body: dict[str, object]) -> float | None:
    """TTFT in ms of one stream, read to its end; None if the server closed the connection before answering
    (llama-server's HTTP library ends a kept-alive connection after a few requests)."""
    started = time.perf_counter()
    try:
        with http.stream("POST", url, json=body) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {") and '"content"' in line:
                    break
            elapsed = (time.perf_counter() - started) * 1000.0
            for _ in lines:  # the rest of the stream, off the clock
                pass
    except httpx.RemoteProtocolError:
        return None
    return elapsed


def core(build: llamacpp.Build, model: Path, tmp: Path, requests: int) -> dict[str, list[float]]:
    """TTFT (ms) of the same one-token request, straight to the server and through the gateway, alternating."""
    with LlamaServer(build.binary, model, tmp, slots=1, threads=2) as server:
        server.start().wait_ready()
        backend = f'{{type: llamacpp, base_url: "{server.base_url}"}}'
        config = f"backends:\n  llama: {backend}\nmodels:\n  tiny: {{backend: llama}}\n"
        gateway, base = start_gateway(config, tmp)
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Say ok."}],
            "max_tokens": 1,
            "stream": True,
            "temperature": 0,
        }
        found: dict[str, list[float]] = {"direct": [], "through": [], "reconnects": []}
        try:
            with httpx.Client(timeout=30.0) as http:
                for i in range(requests + 10):  # the first ten warm both paths and the prompt cache
                    order = ("direct", "through") if i % 2 else ("through", "direct")
                    for side in order:
                        url = server.base_url if side == "direct" else f"{base}/v1"
                        elapsed = timed(http, f"{url}/chat/completions", body)
                        if elapsed is None:  # the server closed a kept-alive connection: once more, anew
                            found["reconnects"].append(1.0)
                            elapsed = timed(http, f"{url}/chat/completions", body)
                        assert elapsed is not None
                        if i >= 10:
                            found[side].append(elapsed)
        finally:
            stop(gateway)
        return found


def main(seconds: float = 30.0) -> int:
    try:
        build = llamacpp.locate()
    except llamacpp.Unavailable as exc:
        print(f"sluice bench: the real scenario needs llama-server: {exc}", file=sys.stderr)
        return 2
    try:
        model = ensure_model(TINY, build.vocab)
    except ImportError as exc:
        print(f"sluice bench: the real scenario writes its model with the gguf package: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        phases = routing(build, model, tmp, seconds)
        sides = core(build, model, tmp, CORE_REQUESTS if seconds >= 15 else 40)
    print(f"## Against real llama.cpp servers (llama-server b{llamacpp.SDIST_VERSION.split('.')[0]}, {TINY.name})\n")
    print(f"Routing: {REPLICAS} replicas of {SLOTS} slots, {RATE:g} turns/s offered, {seconds:g} s per policy\n")
    columns = "TTFT p50 ms | TTFT p99 ms | cached share | requests per replica | busiest / mean | failed | cut"
    print(f"| policy | requests | {columns} |")
    print("|---|---|---|---|---|---|---|---|---|")
    for phase in phases:
        print(phase.line())
    direct, through = sorted(sides["direct"]), sorted(sides["through"])
    print(f"\nCore: one server, a cached 1-token chat, {len(direct)} requests a side, alternating\n")
    print("| side | TTFT p50 ms | TTFT p99 ms |")
    print("|---|---|---|")
    for name, values in (("direct", direct), ("through the gateway", through)):
        print(f"| {name} | {percentile(values, 0.5):.2f} | {percentile(values, 0.99):.2f} |")
    added = statistics.median(t - d for t, d in zip(sides["through"], sides["direct"], strict=True))
    print(f"\nThe gateway's part (median of paired differences): {added:.2f} ms")
    print(f"Direct requests sent again after llama-server closed a kept-alive connection: {len(sides['reconnects'])}")
    return 0 if all(phase.failures == 0 for phase in phases) else 1
