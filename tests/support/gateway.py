"""Run the real gateway under uvicorn (uvloop, httptools) on a free loopback port, in a thread or a process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from gateway.app import SERVER_OPTIONS, Gateway, create_app
from gateway.config import parse
from tests.support.wait import wait_until
from tools.bench.fleet import wait_http_ready


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RunningGateway:
    def __init__(
        self,
        port: int,
        proc: subprocess.Popen[bytes] | None = None,
        log: Path | None = None,
        app: Gateway | None = None,
    ) -> None:
        self.port = port
        self.app = app  # the app, when it runs in this process
        self.process = proc  # for gateway_process: the `sluice serve` process
        self.url = f"http://127.0.0.1:{port}"
        self.base_url = f"{self.url}/v1"
        self.proc = proc  # `sluice serve` when run as a process
        self.log = log  # where that process's stderr goes

    def log_text(self) -> str:
        return self.log.read_text() if self.log is not None else ""

    def store_available(self) -> bool:
        """The gateway's Redis client would try Redis again: its circuit breaker's cool-down is over."""
        runtime = self.app.runtime if self.app is not None else None
        return runtime is not None and runtime.store is not None and runtime.store.available

    def settle(self, timeout: float = 10.0) -> None:
        """Wait until no request is in flight and every completion task (cache store, SLO sample) is done."""
        assert self.app is not None, "only for a gateway in this process"
        app = self.app

        def settled() -> bool:
            return app.runtime is not None and app.runtime.pipeline.busy == 0

        wait_until(settled, timeout, interval=0.005, what="completion tasks done")


# Start-up imports the SDKs, warms pools and starts plugins: on a loaded 2-core machine that can take many
# seconds, so readiness is waited for generously (a gateway that never comes up still fails the test).
READY_TIMEOUT_S = 60.0


def wait_ready(
    url: str, timeout: float = READY_TIMEOUT_S, path: str = "/readyz", proc: subprocess.Popen[bytes] | None = None
) -> None:
    wait_http_ready(url, timeout, path, proc)


def serve_in_thread(server: uvicorn.Server) -> threading.Thread:
    """`server` served on a uvloop loop of its own in a daemon thread, started (set `should_exit` to stop it)."""

    def run() -> None:
        import uvloop

        loop = uvloop.new_event_loop()
        try:
            loop.run_until_complete(server.serve())
        finally:
            loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


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

    thread = serve_in_thread(server)
    running = RunningGateway(port, app=app)
    try:
        wait_ready(running.url, path="/readyz" if ready else "/healthz")
        yield running
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def gateway_process(
    config: str, tmp: Path, *args: str, env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()
) -> Iterator[RunningGateway]:
    """`sluice serve` as its own process, as a user runs it; its stderr goes to `running.log`.

    `args` come after the defaults, so `--log-level debug` there overrides the quiet default; `prefix` runs it
    under another command (`prlimit --nofile=N:N --`).
    """
    port = free_port()
    path = tmp / f"gateway-{port}.yaml"
    path.write_text(config)
    log = tmp / f"gateway-{port}.log"
    stderr = log.open("wb")
    proc = subprocess.Popen(
        [
            *prefix,
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
        stderr=stderr,
    )
    running = RunningGateway(port, proc, log)
    try:
        wait_ready(running.url, proc=proc)
        yield running
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; its log:\n{running.log_text()}") from None
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        stderr.close()
