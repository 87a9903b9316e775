"""One real `llama-server` process on a loopback port: started, waited for, read, restarted and stopped.

Used by the integration tests' fixtures and by `sluice bench --scenario real`. Readiness is llama-server's own:
`GET /health` answers 503 "Loading model" from ~50 ms after spawn until the model is loaded, then 200.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

# Starting takes ~0.1-0.5 s on a quiet machine (4 s with `-lm none`); a loaded 2-core machine can make it
# ten times longer, and a server that never comes up still fails within this.
READY_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class LlamaServer:
    """`llama-server -m MODEL --port P -np SLOTS -c CONTEXT --metrics`, its output in `log`."""

    def __init__(
        self,
        binary: Path,
        model: Path,
        log_dir: Path,
        *,
        slots: int = 1,
        context: int = 4096,
        threads: int = 2,
        alias: str = "tiny",
        extra: Sequence[str] = (),
    ) -> None:
        self.binary, self.model = binary, model
        self.slots, self.context, self.threads, self.alias = slots, context, threads, alias
        self.extra = tuple(extra)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.url}/v1"
        self.log = log_dir / f"llama-server-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def command(self) -> list[str]:
        return [
            str(self.binary),
            "-m",
            str(self.model),
            "--alias",
            self.alias,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-np",
            str(self.slots),
            "-c",
            str(self.context * self.slots),  # -c is shared by the slots: each gets `context`
            "-t",
            str(self.threads),
            "--metrics",
            "--slots",
            *self.extra,
        ]

    def start(self) -> LlamaServer:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT)
        self.starts += 1
        return self

    def health(self) -> int | None:
        """The status of GET /health, None while nothing listens."""
        try:
            return httpx.get(f"{self.url}/health", timeout=2.0).status_code
        except httpx.TransportError:
            return None

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while self.health() != 200:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server on {self.port} not ready within {timeout} s: {self.log_tail()}")
            time.sleep(0.02)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def restart(self) -> None:
        """Stopped and started again on the same port: its slots and prompt cache start empty."""
        self.stop()
        self.start()

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def metrics(self) -> dict[str, float]:
        """`/metrics` as {name without the `llamacpp:` prefix: value} (its series carry no labels)."""
        values: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=5.0).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name.removeprefix("llamacpp:")] = float(value)
        return values

    def slot_states(self) -> list[dict[str, Any]]:
        slots: list[dict[str, Any]] = httpx.get(f"{self.url}/slots", timeout=5.0).json()
        return slots

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()
