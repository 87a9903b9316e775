"""Requests in flight per tenant, capped: no tenant can hold every upstream connection of a process.

A request counts from its admission until its last byte (a stream until its end, however it ends), in this
process: the connections it would exhaust (`pool.max_connections` per backend) are this process's too.
Over the cap, the request is refused at once with a 429 `concurrency_limit` naming the cap, before any
bucket is charged, so the refusal costs the tenant nothing of its rate limits.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.errors import RateLimitError

CODE = "concurrency_limit"
# A slot frees when one of the tenant's requests ends: there is no schedule to report, so a short retry.
RETRY_AFTER_MS = b"1000"


class Concurrency:
    def __init__(self, caps: Mapping[str, int], default: int) -> None:
        self.caps = dict(caps)  # tenant -> its own cap; every other tenant has `default`
        self.default = default
        self.inflight: dict[str, int] = {}

    def enter(self, tenant: str) -> None:
        """Count one more of `tenant`'s requests in flight, or raise the 429 when it is at its cap."""
        inflight = self.inflight.get(tenant, 0)
        if inflight >= self.caps.get(tenant, self.default):
            raise self._refusal(tenant)
        self.inflight[tenant] = inflight + 1

    def leave(self, tenant: str) -> None:
        left = self.inflight[tenant] - 1
        if left:
            self.inflight[tenant] = left
        else:
            del self.inflight[tenant]  # idle tenants leave nothing behind

    def _refusal(self, tenant: str) -> RateLimitError:
        # A new error each time: an exception raised again keeps growing the traceback it carries.
        cap = self.caps.get(tenant, self.default)
        source = f"tenants.{tenant}.max_concurrent" if tenant in self.caps else "rate_limit.max_concurrent"
        return RateLimitError(
            f"Too many concurrent requests for tenant {tenant}: limit {cap} in flight ({source}). "
            "Please try again when one of them has ended.",
            type="requests",
            code=CODE,
            headers=[(b"retry-after", b"1"), (b"retry-after-ms", RETRY_AFTER_MS)],
        )
