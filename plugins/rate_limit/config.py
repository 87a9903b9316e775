"""rate_limit's configuration: its section, a tenant's limits. Apart from the limiter so that the limiter's module
can be compiled (mypyc, docs/architecture.md): pydantic models stay interpreted."""

from __future__ import annotations

from pydantic import Field

from gateway.settings import Strict

__all__ = ["Limits", "RateLimitSection", "RateLimitTenant", "TenantLimits"]


class Limits(Strict):
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)


class TenantLimits(Limits):
    models: dict[str, Limits] = Field(default_factory=dict)  # per tenant and model, on top of the tenant-wide limits


class RateLimitSection(Strict):
    """`rate_limit:`"""

    # Requests in flight per tenant and process (streams until their end); a tenant's own `max_concurrent`
    # wins. Unset: half of `pool.max_connections`, so that no tenant alone can hold a backend's connections.
    max_concurrent: int | None = Field(None, ge=1)

    # Tokens reserved at admission for a request that sets no max_tokens; corrected from usage afterwards.
    default_max_tokens: int = Field(1024, ge=1)
    # With Redis, each process admits from leases of the shared buckets (see docs/rate-limits.md): a lease holds
    # at most this share of a limit, lapses this long after it was granted, and a request whose lease is empty
    # waits this long for a sync before it is decided in process.
    lease_share: float = Field(0.005, gt=0, le=1)
    lease_ttl_s: float = Field(1.0, gt=0, le=60)
    sync_wait_ms: float = Field(20.0, ge=0, le=1000)


class RateLimitTenant(Strict):
    """Its keys under `tenants.NAME`."""

    rate_limit: TenantLimits = TenantLimits()
    max_concurrent: int | None = Field(None, ge=1)  # requests in flight, per process
