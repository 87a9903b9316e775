"""The processes of a `sluice bench` run: where they are pinned, how they start and stop, what they cost.

Every process is a child started here on 127.0.0.1 and stopped by its `Child`: the simulated upstreams
(`sluice sim`), the gateways (`sluice serve`), a throwaway `redis-server` and the OTLP sinks. CPU time comes
from /proc, so the report can say how busy each CPU was and with what.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

CLK_TCK = os.sysconf("SC_CLK_TCK")
BENCH_DIR = Path("bench")


class BenchError(Exception):
    """The benchmark could not run (a process did not start, a port did not open, a file is missing)."""


@dataclass(frozen=True, slots=True)
class Placement:
    gateway_cpu: int | None
    harness_cpu: int | None
    note: str


@dataclass(slots=True)
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    log: IO[bytes]
    workdir: str | None = None  # removed on stop

    def cpu_seconds(self) -> float:
        data = Path(f"/proc/{self.popen.pid}/stat").read_bytes()
        fields = data[data.rindex(b")") + 2 :].split()  # the name may hold spaces; fields[0] is field 3
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def peak_rss_mb(self) -> float:
        for line in Path(f"/proc/{self.popen.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
        return math.nan

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-2000:].strip()

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise BenchError(f"{self.name} exited with status {self.popen.returncode}: {self.output()}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self.log.close()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def busy_seconds(name: str) -> float:
    """A /proc/stat line's time not idle; steal counts as busy, since the CPU was not ours then."""
    for line in Path("/proc/stat").read_text().splitlines():
        fields = line.split()
        if fields[0] == name:
            ticks = [int(value) for value in fields[1:9]]  # user nice system idle iowait irq softirq steal
            return (sum(ticks) - ticks[3] - ticks[4]) / CLK_TCK
    return math.nan


def proc_net_counter(path: str, prefix: str, name: str) -> float:
    with contextlib.suppress(OSError, ValueError, IndexError):
        header, values = [line.split() for line in Path(path).read_text().splitlines() if line.startswith(prefix)][:2]
        return float(values[header.index(name)])
    return 0.0


def tcp_counters() -> tuple[float, float]:
    """Machine-wide: TCP segments retransmitted, retransmission timeouts."""
    retransmits = proc_net_counter("/proc/net/snmp", "Tcp:", "RetransSegs")
    timeouts = proc_net_counter("/proc/net/netstat", "TcpExt:", "TCPTimeouts")
    return retransmits, timeouts


def placement(pin: bool) -> Placement:
    cpus = sorted(os.sched_getaffinity(0))
    if not pin:
        return Placement(None, None, "unpinned (pinning turned off)")
    if shutil.which("taskset") is None:
        return Placement(None, None, "unpinned: taskset not found, so all processes share every CPU")
    if len(cpus) < 2:
        return Placement(None, None, "unpinned: fewer than two CPUs available")
    gw, harness = cpus[0], cpus[1]
    return Placement(
        gw, harness, f"gateways on CPU {gw}; upstreams, Redis, OTLP sinks and load generator on CPU {harness} (taskset)"
    )


def machine() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load = os.getloadavg()[0]
    return (
        f"{len(os.sched_getaffinity(0))} CPUs ({model}), Linux {platform.release()}, "
        f"Python {platform.python_version()}; load average {load:.2f} at the start"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def bench_file(name: str) -> Path:
    """A file under bench/: from the working directory, else from the source tree this module belongs to."""
    found = BENCH_DIR / name
    if not found.exists():
        found = Path(__file__).resolve().parents[2] / BENCH_DIR / name
    if not found.exists():
        raise BenchError(f"not found: {BENCH_DIR / name} (run from the source tree)")
    return found.resolve()


def pinned(cpu: int | None) -> list[str]:
    """The prefix that runs a command on `cpu` (taskset), or nothing where the placement pins nothing."""
    return ["taskset", "-c", str(cpu)] if cpu is not None else []


def spawn(
    name: str,
    command: list[str],
    cpu: int | None,
    env: dict[str, str],
    workdir: str | None = None,
    cwd: str | None = None,
) -> Child:
    """A child process; `workdir` is its working directory and removed when it stops, `cwd` one that is kept."""
    prefix = pinned(cpu)
    log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the child; Child.stop closes it
    popen = subprocess.Popen(
        [*prefix, *command],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=log,
        env=env,
        cwd=cwd or workdir,
    )
    return Child(name, popen, log, workdir)


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def start_sim(name: str, port: int, tpot_ms: float, tokens: int, cpu: int | None, env: dict[str, str]) -> Child:
    args = ["sim", "--port", str(port), "--ttft-ms", "0", "--tpot-ms", f"{tpot_ms:g}", "--tokens", str(tokens)]
    return spawn(f"sim {name}", python_module("gateway.cli", *args), cpu, env)


def start_gateway(name: str, config: Path, port: int, cpu: int | None, env: dict[str, str]) -> Child:
    args = ["serve", "-c", str(config), "--port", str(port), "--log-level", "warning"]
    return spawn(f"gateway {name}", python_module("gateway.cli", *args), cpu, env)


def start_redis(port: int, cpu: int | None, env: dict[str, str]) -> Child:
    binary = shutil.which("redis-server")
    if binary is None:
        raise BenchError(
            "redis-server not found: the tenants and cache scenarios need it (apt-get install redis-server)"
        )
    workdir = tempfile.mkdtemp(prefix="sluice-bench-redis-")
    # No persistence: nothing is written, and no fork for a snapshot disturbs the timings.
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    return spawn("redis-server", [*command, "--dir", workdir], cpu, env, workdir)


def start_sink(name: str, port: int, cpu: int | None, env: dict[str, str]) -> Child:
    return spawn(name, python_module("tools.bench.sink", "--port", str(port)), cpu, env)


async def wait_redis(child: Child, port: int, deadline: float) -> None:
    """PING until PONG: a raw socket, so that the harness needs no Redis client."""
    while True:
        child.check_alive()
        with contextlib.suppress(OSError):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(b"PING\r\n")
                if (await reader.readline()).startswith(b"+PONG"):
                    return
            finally:
                writer.close()
        if time.monotonic() > deadline:
            raise BenchError(f"{child.name} not ready within the start-up timeout: {child.output()}")
        await asyncio.sleep(0.05)


T = TypeVar("T")


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run a benchmark's coroutine on uvloop, as the gateway runs, where it is installed."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - platforms without uvloop
        return asyncio.run(main)
    result: T = uvloop.run(main)
    return result


def wait_http_ready(
    url: str, timeout: float, path: str = "/readyz", proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Wait until `url + path` answers 200: a gateway (or anything) started in another process, polled over HTTP."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise TimeoutError(f"{url} exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}{path}", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.02)
    raise TimeoutError(f"{url} not ready within {timeout} s")
