"""What every backend kind provides: turn an Exchange into an upstream response.

Providers are a closed set (openai, azure, vllm, simulated), chosen by `type` in the config and built once
at start-up. A provider owns its connection pool; `gateway/upstream/attempts.py` decides which target to try and
when to give up, the provider only knows how to talk to its kind of backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from prometheus_client import Gauge

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
    """A backend as everything outside its module sees it: callers read nothing else of a provider.

    Views of a backend (the Responses API's `Indexing`, the Messages API's wrappers) and the gateway's own
    stand-ins (a background job's `Starter`) are providers too, so a Target holds any of them.
    """

    @property
    def kind(self) -> str:
        """The backend type in the config (a class variable of each kind; a view's is its backend's)."""
        ...

    @property
    def system(self) -> str:
        """gen_ai.provider.name."""
        ...

    reports_usage: bool  # a stream reports its usage in a last chunk (see server/relay.py)
    usage_of_first_choice: bool  # a whole answer's usage counts its first choice only (llama.cpp's n > 1)
    health: Health  # up, down or warming; the request path reads `health.down` only

    @property
    def url(self) -> str | None:
        """The backend's address as configured (spans' server.address); None where there is none."""
        ...

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

    def report(self) -> dict[str, Any]:
        """The backend's state for /status (with several endpoints, each one's too)."""
        ...

    def instrument(self, gauge: Gauge) -> None:
        """Report each endpoint's health on `gauge` (backend, endpoint); nothing where there are no endpoints."""
        ...

    def in_service(self) -> int:
        """How many endpoints (replicas) are in service now: what admission scales a backend's capacity by."""
        ...

    def endpoint_urls(self) -> list[str]:
        """The base URLs of the endpoints in service (none for a backend in this process): where admission reads
        an engine's own capacity."""
        ...

    async def aclose(self) -> None: ...


class View:
    """A backend seen through another API (the Responses API's `Indexing`, the Messages API's wrappers): the
    backend's own provider in everything but `send`, which each view writes.

    The backend itself (in `Upstreams.providers`) is what gets started, instrumented and closed; a view of it
    only borrows its state, so those are no-ops here, and its report, readiness and endpoints are the backend's.
    """

    def __init__(self, inner: Provider) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.system = inner.system
        self.health = inner.health  # read by the attempt loop: a backend known down is tried last
        self.reports_usage = inner.reports_usage
        self.usage_of_first_choice = inner.usage_of_first_choice

    @property
    def url(self) -> str | None:
        return self.inner.url

    @property
    def ready(self) -> bool:
        return self.inner.ready

    async def start(self) -> None:
        return None

    def report(self) -> dict[str, Any]:
        return self.inner.report()

    def instrument(self, gauge: Gauge) -> None:
        return None

    def in_service(self) -> int:
        return self.inner.in_service()

    def endpoint_urls(self) -> list[str]:
        return self.inner.endpoint_urls()

    async def aclose(self) -> None:
        return None
