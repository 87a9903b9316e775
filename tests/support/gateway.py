"""Run the real gateway under uvicorn (uvloop, httptools) on a free loopback port, in a thread or a process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

from gateway.app import SERVER_OPTIONS, create_app
from gateway.config import parse


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RunningGateway:
    def __init__(self, port: int, process: subprocess.Popen[bytes] | None = None) -> None:
        self.port = port
        self.process = process  # for gateway_process: the `sluice serve` process
        self.url = f"http://127.0.0.1:{port}"
        self.base_url = f"{self.url}/v1"


def wait_ready(url: str, timeout: float = 15.0, path: str = "/readyz") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}{path}", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.02)
    raise TimeoutError(f"gateway at {url} not ready within {timeout} s")


@contextmanager
def gateway_thread(config: str, ready: bool = True) -> Iterator[RunningGateway]:
    """The gateway for a YAML config, served by uvicorn in a thread of this process.

    With `ready=False` it is handed over once it answers at all, warm upstream pools or not.
    """
    port = free_port()
    app = create_app(parse(config, "<test config>"))
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            loop="none",
            log_level="warning",
            **SERVER_OPTIONS,  # type: ignore[arg-type]
        )
    )

    def run() -> None:
        import uvloop

        loop = uvloop.new_event_loop()
        try:
            loop.run_until_complete(server.serve())
        finally:
            loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    running = RunningGateway(port)
    try:
        wait_ready(running.url, path="/readyz" if ready else "/healthz")
        yield running
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def gateway_process(config: str, tmp: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[RunningGateway]:
    """`sluice serve` as its own process, as a user runs it."""
    port = free_port()
    path = tmp / f"gateway-{port}.yaml"
    path.write_text(config)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "-c",
            str(path),
            "--port",
            str(port),
            "--log-level",
            "warning",
            *args,
        ],
        env={**os.environ, **(env or {})},
    )
    running = RunningGateway(port, proc)
    try:
        wait_ready(running.url)
        yield running
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
