"""The shared Redis client, behind a circuit breaker, for the plugins that keep state across processes.

Redis is an accelerator here, never a dependency of answering: every call has a short deadline and is
tried once, and a call that fails raises `StoreUnavailable` so that its caller falls back by its rule. After a
failure the breaker stays open for a cool-down, during which calls fail at once, untried: for the request
path's stages, which all fail open (a cache misses, a rate limit decides in process), a second of fallback is
cheap and a Redis in trouble is not asked again and again.

Decisions about who may see or change an object fail closed, so there a late reply is a refused request, and a
breaker opened by someone else's slow call an outage. They go through a store of their own (`decisions`): its
own connections (a request-path burst never queues in front of them), a longer deadline
(`redis.decision_timeout_ms`), its own breaker, and one that tells slow from down:

- down: the connection is refused, reset or lost, cannot be opened in time, or has answered nothing for
  `resp.SILENT_S` while calls waited (stopped, or stalled). The breaker opens for the cool-down.
- slow: a reply missed its deadline on a connection that still answers (a busy server, a machine short of
  CPU). That one call fails; the breaker stays closed, so one late reply never refuses everyone else.

The first failure and the recovery are logged once each; failures are counted for the metrics.

A few calls bypass the breaker (`pipeline(..., always=True)`): those whose failure costs more than one more
slow call, made in the background a few times a second at most. A background job's lease renewal is one: a
single timed-out call must not keep a live owner from renewing for the whole cool-down, or its healthy jobs
would be taken as lost by the other instances.

Callers speak in commands (`execute("GET", key)`, `pipeline([...])`, `run(script, keys, args)`), never in a
client library's objects. Underneath is the lean pipelined client of `resp.py` (a single server) or
`cluster.py` (a Redis Cluster, `redis+cluster://`); replies are RESP as it comes: bytes, int, list or None.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

from gateway.state.cluster import Cluster
from gateway.state.resp import Arg, Client, Redis, ReplyError, SlowReply, node_urls, parse_url

log = logging.getLogger("sluice.store")


class StoreUnavailable(Exception):
    """Redis is down, slow or not configured: use the in-process fallback."""


class Script:
    """A Lua script run by its SHA1 (EVALSHA), loaded again when Redis has forgotten it (NOSCRIPT)."""

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source: Final = source
        self.sha: Final = hashlib.sha1(source.encode()).hexdigest()


def connect(url: str, **limits: Any) -> Client:
    """The client for `url`: a single server, or a cluster found from its seeds. Nothing is opened yet."""
    addresses, options, cluster = parse_url(url, **limits)
    if cluster:
        return Cluster(url, addresses, options)
    return Redis(url, addresses[0], options)


class Store:
    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 0.05,
        connect_timeout_s: float = 0.2,
        cooldown_s: float = 1.0,
        connections: int = 2,
        patient: bool = False,
    ) -> None:
        self.url = url
        self.patient = patient  # a late reply fails its call but does not open the breaker (see `decisions`)
        self.connect_timeout_s = connect_timeout_s
        self.connections = connections
        # A few connections per server carry every call, pipelined: a burst queues on them (within the
        # deadline) instead of opening more connections, so it never opens the breaker while Redis is fine.
        self.client = connect(url, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s, connections=connections)
        self.cooldown_s = cooldown_s
        self.open_until = 0.0  # while time.monotonic() is below this, calls are not even tried
        self.down = False
        self.failures = 0  # total, for metrics
        # Whose `failures` this store's failures count in: its own, or (for `decisions`) the store it was made
        # from, so that the one Redis failure metric sees both sets of connections.
        self.tally: Store = self
        self.late = 0  # of those, replies that missed their deadline while the server still answered

    def decisions(self, timeout_s: float) -> Store:
        """A store on the same server for the calls that decide who may see or change an object: its own
        connections and breaker, and a deadline long enough that a busy machine is not mistaken for an outage."""
        store = Store(
            self.url,
            timeout_s=timeout_s,
            connect_timeout_s=max(self.connect_timeout_s, timeout_s),
            cooldown_s=self.cooldown_s,
            connections=self.connections,
            patient=True,
        )
        store.tally = self
        return store

    @property
    def node_urls(self) -> list[str]:
        """A plain URL per node named by `url` (a cluster's seeds), for redis-py clients off the request path."""
        return node_urls(self.url)

    @property
    def available(self) -> bool:
        return time.monotonic() >= self.open_until

    def retry_in_s(self) -> float:
        """Seconds until the breaker lets a call through again (0 or less: now)."""
        return self.open_until - time.monotonic()

    async def execute(self, *command: Arg) -> Any:
        """One command, one round trip: `await store.execute("GET", key)`."""
        # _check and _guarded written out: the request path's Redis calls come this way, and each call or
        # awaited coroutine saved is about a thousand instructions.
        if time.monotonic() < self.open_until:
            raise StoreUnavailable("redis circuit open")
        try:
            result = await self.client.call(command)
        except Exception as exc:
            raise self._trip(exc) from exc
        except asyncio.CancelledError as cancelled:  # its own name: compiled, an except name has one type
            raise self._stray(cancelled) from None
        if self.down:
            self._recovered()
        return result

    async def pipeline(self, commands: Sequence[Sequence[Arg]], *, always: bool = False) -> list[Any]:
        """Several commands in one round trip; a command's error is returned in its place, not raised.

        `always`: outside the breaker (see above), both ways: sent even while it is open, and neither its
        failure opens it nor its success closes it, so a call made in the background on its own schedule
        never changes what the request path does. Its failures are counted all the same.
        """
        if always:
            try:
                return await self.client.pipeline(commands)
            except Exception as exc:
                self.tally.failures += 1
                raise StoreUnavailable(str(exc) or type(exc).__name__) from exc
        self._check()
        return await self._guarded(self.client.pipeline(commands))  # type: ignore[no-any-return]

    async def scan(self, match: str, each: Callable[[list[bytes]], None]) -> None:
        """`each` batch of the keys matching `match` (every master's, on a cluster), off the request path:
        outside the breaker both ways, as `pipeline(..., always=True)`; a failure is counted and raised as
        StoreUnavailable, and the scan is over (a caller that needs it whole starts again)."""
        try:
            await self.client.scan(match, each)
        except Exception as exc:
            self.tally.failures += 1
            raise StoreUnavailable(str(exc) or type(exc).__name__) from exc

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        """EVALSHA `script`; a Redis that has forgotten it (restarted, flushed) is sent the source (EVAL)."""
        self._check()
        return await self._guarded(self._run(script, keys, args))

    async def _run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        try:
            return await self.client.call(("EVALSHA", script.sha, len(keys), *keys, *args))
        except ReplyError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
            # EVAL runs the script and caches it, in the same round trip and on the node that owns the keys.
            return await self.client.call(("EVAL", script.source, len(keys), *keys, *args))

    async def _guarded(self, call: Awaitable[Any]) -> Any:
        try:
            result = await call
        except Exception as exc:  # refused, reset, timed out, an error reply: all mean use the fallback
            raise self._trip(exc) from exc
        except asyncio.CancelledError as cancelled:  # its own name: compiled, an except name has one type
            raise self._stray(cancelled) from None
        self._recovered()
        return result

    def _check(self) -> None:
        if time.monotonic() < self.open_until:
            raise StoreUnavailable("redis circuit open")

    def _trip(self, exc: Exception) -> StoreUnavailable:
        self.tally.failures += 1
        if self.patient and isinstance(exc, SlowReply):  # slow, not down: this call fails, the others are tried
            self.late += 1
            return StoreUnavailable(str(exc))
        self.open_until = time.monotonic() + self.cooldown_s
        if not self.down:
            self.down = True
            log.warning("redis unavailable (%s): falling back to in-process state", type(exc).__name__)
        return StoreUnavailable(str(exc) or type(exc).__name__)

    def _stray(self, exc: asyncio.CancelledError) -> BaseException:
        """A cancellation from below that nobody asked of the caller (something the client awaited was
        cancelled): a failed call like any other, so that the caller falls back by its rule. The caller's own
        cancellation (a client gone, a shutdown) goes on as it came."""
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            return exc
        log.warning("redis call cancelled from below, taken as a failure", exc_info=exc)
        return self._trip(ConnectionError("redis call cancelled"))

    def _recovered(self) -> None:
        if self.down:
            self.down = False
            log.warning("redis is back")

    async def aclose(self) -> None:
        await self.client.aclose()
