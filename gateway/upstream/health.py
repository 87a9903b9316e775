"""Backend health: up, down or warming, as the gateway last saw it; what failed last, and when.

One `Health` per backend, owned by its provider. The request path only reads a flag (`down`, to route
around a backend known to be down) and reports what it saw (a connect failure, an answer); the provider's
background loop retries a down backend with back-off. Every transition is one log line. Readiness does not
depend on it: a pod whose upstream is down cannot fix that by leaving the rotation.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("sluice.upstream")

EXHAUSTED_LOG_EVERY_S = 10.0  # at most one "pool exhausted" line per backend in this time


class Health:
    __slots__ = (
        "_exhausted_logged",
        "_exhausted_since_log",
        "changed_at",
        "down",
        "error",
        "error_at",
        "in_process",
        "name",
        "pool_exhausted",
        "state",
        "warm",
    )

    def __init__(self, name: str) -> None:
        self.name = name
        self.state = "warming"
        self.down = False  # the flag the request path reads
        self.warm = 0  # idle connections after the last warm-up or top-up
        self.in_process = False  # the built-in simulated backend: no connections at all, so none to report
        self.error: str | None = None  # the last failure seen
        self.error_at: float | None = None  # time.time() of it
        self.changed_at = time.time()
        self.pool_exhausted = 0  # requests refused for want of a connection, in total (for metrics)
        self._exhausted_logged = 0.0
        self._exhausted_since_log = 0

    def mark_up(self, warm: int | None = None) -> None:
        if warm is not None:
            self.warm = warm
        if self.state != "up":
            if self.state == "down":
                log.warning("backend %s is up again (%d warm connection(s))", self.name, self.warm)
            self._set("up")

    def mark_down(self, error: str) -> None:
        self.error = error
        self.error_at = time.time()
        self.warm = 0
        if self.state != "down":
            log.warning("backend %s is down: %s (retrying in the background)", self.name, error)
            self._set("down")

    def exhausted(self) -> None:
        """A request found no free connection within the pool timeout: counted, and logged now and then."""
        self.pool_exhausted += 1
        self._exhausted_since_log += 1
        now = time.monotonic()
        if now - self._exhausted_logged >= EXHAUSTED_LOG_EVERY_S:
            log.warning(
                "backend %s: connection pool exhausted, %d request(s) refused with 503 (raise pool.max_connections?)",
                self.name,
                self._exhausted_since_log,
            )
            self._exhausted_logged = now
            self._exhausted_since_log = 0

    def report(self) -> dict[str, Any]:
        return {
            "state": self.state,
            # null, not 0, for a backend with no connections: 0 would read as a warm-up that failed.
            "warm_connections": None if self.in_process else self.warm,
            "since": _iso(self.changed_at),
            "last_error": self.error,
            "last_error_at": _iso(self.error_at) if self.error_at is not None else None,
        }

    def _set(self, state: str) -> None:
        self.state = state
        self.down = state == "down"
        self.changed_at = time.time()


def _iso(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
