"""The shared Redis client, behind a circuit breaker, for the plugins that keep state across processes.

Redis is an accelerator here, never a dependency of answering: every call has a short timeout and at most
one immediate retry on a broken connection (redis-py 8 would otherwise retry ten times with back-off,
seconds of latency when Redis is down),
and after a failure the breaker stays open for a cool-down, during which calls fail at once with
`StoreUnavailable` and callers fall back to what they have in process. The first failure and the
recovery are logged once each; failures are counted for the metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError, RedisError

log = logging.getLogger("sluice.store")

T = TypeVar("T")


class StoreUnavailable(Exception):
    """Redis is down, slow or not configured: use the in-process fallback."""


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
        self.client = aioredis.Redis(connection_pool=self.pool)
        self.cooldown_s = cooldown_s
        self.open_until = 0.0  # while time.monotonic() is below this, calls are not even tried
        self.down = False
        self.failures = 0  # total, for metrics

    @property
    def available(self) -> bool:
        return time.monotonic() >= self.open_until

    async def call(self, operation: Callable[[aioredis.Redis], Awaitable[T]]) -> T:
        if time.monotonic() < self.open_until:
            raise StoreUnavailable("redis circuit open")
        try:
            result = await operation(self.client)
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
