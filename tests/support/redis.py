"""A real redis-server on a free loopback port, started and stopped by the tests themselves."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable

import redis

from tests.support.gateway import free_port

# The servers the Redis-backed tests run against, each where it is installed: Redis, and Valkey (its fork,
# which managed offerings now run), which must behave the same for every command the gateway sends.
SERVERS = {"redis": "redis-server", "valkey": "valkey-server"}
INSTALL = {
    "redis-server": "apt-get install redis-server",
    "valkey-server": "apt-get install -t bookworm-backports valkey-server",
}


class RedisServer:
    def __init__(self, *extra: str, program: str = "redis-server") -> None:
        self.extra = list(extra)
        binary = shutil.which(program)
        if binary is None:
            raise RuntimeError(f"{program} is not installed ({INSTALL.get(program, 'install it')})")
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tempfile.mkdtemp(prefix="sluice-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if self.proc.poll() is not None:  # e.g. an option this build does not know
                        status = self.proc.returncode
                        raise RuntimeError(f"{self.binary} exited at start with status {status}") from None
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class RedisCluster:
    """A real Redis Cluster on loopback: 3 masters with a replica each, slots spread by redis-cli."""

    def __init__(self, masters: int = 3) -> None:
        self.servers: list[RedisServer] = []
        for _ in range(masters * 2):
            server = RedisServer()
            server.port = cluster_port()
            server.extra = [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{server.port}.conf",
                "--cluster-node-timeout",
                "1000",
            ]
            self.servers.append(server)
        self.url = "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers[:2])

    def start(self) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed (apt-get install redis-tools)")
        for server in self.servers:
            server.start()
        if not self.client(self.servers[0].port).info("cluster").get("cluster_enabled"):
            raise RuntimeError("this redis-server has no cluster support")
        addresses = [f"127.0.0.1:{s.port}" for s in self.servers]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "1", "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=60,
        )
        self.wait_until_ok()

    def wait_until_ok(self, timeout_s: float = 30.0) -> None:
        """Every live node says `cluster_state:ok` and sees all 16384 slots served by a live master."""
        deadline = time.monotonic() + timeout_s
        while True:
            if all(self.node_ok(s) for s in self.servers if s.proc is not None):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok in time")
            time.sleep(0.05)

    def node_ok(self, server: RedisServer) -> bool:
        live = {s.port for s in self.servers if s.proc is not None}
        with self.client(server.port) as client:
            try:
                if "cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                    return False
                ranges = client.execute_command("CLUSTER", "SLOTS")
            except redis.RedisError:
                return False
        covered: int = sum(end - start + 1 for start, end, master, *_ in ranges if master[1] in live)
        return covered == 16384

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=2, decode_responses=True)

    def master_of(self, key: str) -> RedisServer:
        """The server that serves `key`'s slot now, as a live node sees it."""
        with self.client(next(s.port for s in self.servers if s.proc is not None)) as client:
            slot = client.execute_command("CLUSTER", "KEYSLOT", key)
            for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return next(s for s in self.servers if s.port == master[1])
        raise LookupError(key)

    def is_master(self, port: int) -> bool:
        with self.client(port) as client:
            return bool(client.info("replication").get("role") == "master")

    def wait_until(self, condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if condition():
                    return
            except (redis.RedisError, LookupError, StopIteration):
                pass  # a node mid-failover: ask again
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not reach the expected state in time")
            time.sleep(0.05)

    def wait_until_synced(self, replica: RedisServer) -> None:
        def synced() -> bool:
            with self.client(replica.port) as client:
                return bool(client.info("replication").get("master_link_status") == "up")

        self.wait_until(synced)

    def replica_of(self, master: RedisServer) -> RedisServer:
        for server in self.servers:
            if server is not master and server.proc is not None:
                with self.client(server.port) as client:
                    replication = client.info("replication")
                if replication.get("role") == "slave" and replication.get("master_port") == master.port:
                    return server
        raise LookupError(f"no replica of 127.0.0.1:{master.port}")

    def kill(self, server: RedisServer) -> None:
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        server.proc = None

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
            shutil.rmtree(server.dir, ignore_errors=True)

    def __enter__(self) -> RedisCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()
