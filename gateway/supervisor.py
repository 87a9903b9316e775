"""The worker processes of `sluice serve --workers N`, each listening on a socket of its own (SO_REUSEPORT).

uvicorn's own supervisor binds one socket and hands that same socket to every worker. They all wait on it,
and whichever wakes first accepts every connection queued (libuv accepts until the queue is empty): a burst
of new connections lands on one worker while the others stay idle, and with keep-alive clients it stays
there for as long as those connections live. Measured with 32 keep-alive client connections opened at once
against two workers, one worker took all 32 in most runs.

Here every worker is given a listening socket of its own, all bound to the same address with SO_REUSEPORT,
so the kernel spreads new connections over the workers (by a hash of the connection's addresses and ports).
The parent binds and listens on them before any worker starts, so a connection that arrives while a worker is
starting, or being replaced, waits in its socket's queue instead of being refused.

The supervision itself is uvicorn's: its `Process` (the worker, pinged over a pipe every half second), a dead
or hung worker replaced on the same socket, SIGHUP restarting each worker in turn, SIGTTIN / SIGTTOU adding or
removing one, SIGINT / SIGTERM stopping them all.
"""

from __future__ import annotations

import logging
import socket

from uvicorn.config import STARTUP_FAILURE, Config
from uvicorn.supervisors.multiprocess import Multiprocess, Process

log = logging.getLogger("uvicorn.error")


def listening_sockets(host: str, port: int, count: int, backlog: int) -> list[socket.socket]:
    """`count` sockets listening on one address; port 0 is resolved by the first, and the others share it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    found: list[socket.socket] = []
    try:
        for _ in range(count):
            found.append(bound(family, host, port, backlog))
            port = found[0].getsockname()[1]
    except BaseException:
        for sock in found:
            sock.close()
        raise
    return found


def bound(family: socket.AddressFamily, host: str, port: int, backlog: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


class Supervisor(Multiprocess):
    """uvicorn's supervisor, with worker `i` always serving on socket `i`."""

    def __init__(self, config: Config, sockets: list[socket.socket]) -> None:
        super().__init__(config, sockets)
        self.processes_num = len(sockets)

    def spawn(self, index: int) -> Process:
        process = Process(self.config, [self.sockets[index]])
        process.start()
        return process

    def init_processes(self) -> None:
        self.processes = [self.spawn(index) for index in range(len(self.sockets))]

    def keep_subprocess_alive(self) -> None:
        if self.should_exit.is_set():
            return  # exiting: the workers are being stopped
        for index, process in enumerate(self.processes):
            if process.is_alive(timeout=self.config.timeout_worker_healthcheck):
                continue
            process.kill()  # hung, or already gone
            process.join()
            if process.exitcode == STARTUP_FAILURE:
                # It failed before serving: the app or its config is broken and would fail again on every restart.
                log.error("Child process [%s] failed to start, stopping the parent process.", process.pid)
                self.should_exit.set()
                return
            if self.should_exit.is_set():
                return
            log.info("Child process [%s] died", process.pid)
            self.processes[index] = self.spawn(index)

    def restart_all(self) -> None:
        """Each worker in turn: its replacement serves on the same socket before the old one is stopped."""
        for index, old in enumerate(self.processes):
            if self.should_exit.is_set():
                return
            new = self.spawn(index)
            if not new.wait_until_ready(self.config.timeout_worker_healthcheck, self.should_exit):
                new.kill()
                new.join()
                if not self.should_exit.is_set():
                    log.error("New child process [%s] was not ready in time; keeping [%s].", new.pid, old.pid)
                return
            old.terminate()
            old.join()
            self.processes[index] = new

    def handle_ttin(self) -> None:
        log.info("Received SIGTTIN, increasing the number of processes.")
        first = self.sockets[0]
        host, port = first.getsockname()[:2]
        self.sockets.append(bound(first.family, host, port, self.config.backlog))
        self.processes.append(self.spawn(len(self.sockets) - 1))
        self.processes_num = len(self.processes)

    def handle_ttou(self) -> None:
        log.info("Received SIGTTOU, decreasing number of processes.")
        if len(self.processes) <= 1:
            log.info("Already reached one process, cannot decrease the number of processes anymore.")
            return
        process = self.processes.pop()
        process.terminate()
        process.join()
        # Connections still queued on its socket are refused when it closes: the others' queues take new ones.
        self.sockets.pop().close()
        self.processes_num = len(self.processes)
