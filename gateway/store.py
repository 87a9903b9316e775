"""The shared Redis client, behind a circuit breaker, for the plugins that keep state across processes.

Redis is an accelerator here, never a dependency of answering: every call has a short timeout and at most
one immediate retry on a broken connection (redis-py 8 would otherwise retry ten times with back-off,
seconds of latency when Redis is down),
and after a failure the breaker stays open for a cool-down, during which calls fail at once with
`StoreUnavailable` and callers fall back to what they have in process. The first failure and the
recovery are logged once each; failures are counted for the metrics.

Callers speak in commands (`execute("GET", key)`, `pipeline([...])`, `run(script, keys, args)`), never in a
client library's objects, so that the client underneath can change without touching them.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError, NoScriptError, RedisError

log = logging.getLogger("sluice.store")

T = TypeVar("T")
Arg = str | bytes | int | float


class StoreUnavailable(Exception):
    """Redis is down, slow or not configured: use the in-process fallback."""


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script run by its SHA1 (EVALSHA), loaded again when Redis has forgotten it (NOSCRIPT)."""

    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


class Store:
    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 0.05,
        connect_timeout_s: float = 0.2,
        cooldown_s: float = 1.0,
        max_connections: int = 64,
    ) -> None:
        self.url = url
        # A blocking pool: a burst beyond max_connections waits (within the timeout) for a connection
        # instead of failing at once, which would open the breaker although Redis is fine.
        self.pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=connect_timeout_s,
            # One immediate retry, for connection errors only: it replaces a pooled connection that Redis
            # closed (a restart) at the cost of one refused connect; a slow Redis is never waited on twice.
            retry=Retry(NoBackoff(), 1, supported_errors=(ConnectionError,)),
            health_check_interval=30,
        )
        # Any: redis-py's execute_command is untyped; what comes back is whatever the command answers.
        self.client: Any = aioredis.Redis(connection_pool=self.pool)
        self.cooldown_s = cooldown_s
        self.open_until = 0.0  # while time.monotonic() is below this, calls are not even tried
        self.down = False
        self.failures = 0  # total, for metrics

    @property
    def available(self) -> bool:
        return time.monotonic() >= self.open_until

    async def execute(self, *command: Arg) -> Any:
        """One command, one round trip: `await store.execute("GET", key)`."""
        return await self._guarded(self.client.execute_command(*command))

    async def pipeline(self, commands: Sequence[Sequence[Arg]]) -> list[Any]:
        """Several commands in one round trip; a command's error is returned in its place, not raised."""
        return await self._guarded(self._pipeline(commands))

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        """EVALSHA `script`; a Redis that has forgotten it (restarted, flushed) is given it again."""
        return await self._guarded(self._run(script, keys, args))

    async def _pipeline(self, commands: Sequence[Sequence[Arg]]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return await pipe.execute(raise_on_error=False)  # type: ignore[no-any-return]

    async def _run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        try:
            return await self.client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            await self.client.execute_command("SCRIPT", "LOAD", script.source)
            return await self.client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)

    async def _guarded(self, call: Awaitable[T]) -> T:
        if time.monotonic() < self.open_until:
            close = getattr(call, "close", None)
            if close is not None:
                close()  # never awaited: say so, or Python warns about it
            raise StoreUnavailable("redis circuit open")
        try:
            result = await call
        except (RedisError, OSError, TimeoutError) as exc:
            self.failures += 1
            self.open_until = time.monotonic() + self.cooldown_s
            if not self.down:
                self.down = True
                log.warning("redis unavailable (%s): falling back to in-process state", type(exc).__name__)
            raise StoreUnavailable(str(exc)) from exc
        if self.down:
            self.down = False
            log.warning("redis is back")
        return result

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.pool.aclose()
