"""The process's file-descriptor limit: every open stream holds two sockets, so the soft limit is raised early.

A distribution's default soft limit (often 1,024) caps a gateway near 500 concurrent streams, far below what
one worker can carry; the hard limit is what the operator (systemd's LimitNOFILE, the container runtime)
allows, so the soft one is raised to it before uvicorn binds and the workers, which inherit it, start.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("sluice")


def soft_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def raise_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one; (before, after). An unlimited hard limit is left alone."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # a sandbox that refuses: keep what we have
        return soft, soft
    return soft, hard


def log_limit(before: int, after: int) -> None:
    if after == before:
        log.info("file descriptors: soft limit %d, already at the hard limit", after)
    else:
        log.info("file descriptors: soft limit raised from %d to %d", before, after)
