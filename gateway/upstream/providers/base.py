"""What every backend kind provides: turn an Exchange into an upstream response.

Providers are a closed set (openai, azure, vllm, simulated), chosen by `type` in the config and built once
at start-up. A provider owns its connection pool; `gateway/upstream/attempts.py` decides which target to try and
when to give up, the provider only knows how to talk to its kind of backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    from gateway.context import Exchange, Target
    from gateway.upstream.health import Health


class UpstreamResponse(Protocol):
    """A response whose head has arrived. `gateway.upstream.pool.Response` is the one used for real backends."""

    status: int
    headers: list[tuple[bytes, bytes]]  # names lower-cased
    complete: bool
    acquire_ms: float  # time spent getting a connection for it

    async def next_chunk(self) -> bytes:
        """The next piece of the body (framing removed), b"" at the end; raises PoolError on failure."""
        ...

    async def read(self) -> bytes:
        """The whole body."""
        ...

    def close(self) -> None:
        """Stop reading; an unfinished response aborts its upstream request at once."""
        ...


class Provider(Protocol):
    kind: ClassVar[str]  # the backend type in the config
    system: ClassVar[str]  # gen_ai.provider.name
    reports_usage: bool  # a stream reports its usage in a last chunk (see server/relay.py)
    usage_of_first_choice: bool  # a whole answer's usage counts its first choice only (llama.cpp's n > 1)
    health: Health  # up, down or warming; the request path reads `health.down` only

    async def start(self) -> None:
        """Open and warm connections, bounded by the connect timeout. Failures mark `health` down, never raise."""
        ...

    @property
    def ready(self) -> bool:
        """The warm-up has been attempted, whatever its result."""
        ...

    async def send(self, ex: Exchange, target: Target) -> UpstreamResponse:
        """Send the exchange's request to this backend; return once the response head has arrived."""
        ...

    async def aclose(self) -> None: ...
