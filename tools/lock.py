"""One builder at a time: an exclusive lock on a file, for the builds that runs on one machine cache and share
(llama-server, tools/llamacpp/build.py; the compiled request path, tests/support/compiled.py)."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Held while the block runs; a second holder waits for the first (another process or another session)."""
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
