"""The access log's lines: one per request after it ended, and one per request refused before it was routed."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway import errors
    from gateway.context import Exchange
    from gateway.plugin import Outcome


def refusal_line(
    logger: logging.Logger,
    what: str,
    error: errors.GatewayError,
    rid: str,
    started: float,
    model: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """The access line of a request refused before routing: the same fields, those not known left empty
    (`extra`: what the front door adds, a WebSocket turn's socket)."""
    fields = {
        "request_id": rid,
        "tenant": None,
        "model": model,
        "status": error.status,
        "total_ms": round((time.perf_counter() - started) * 1000.0, 3),
        "rejected_by": "gateway",
        "error": error.code or error.type,
        **(extra or {}),
    }
    logger.info("%s %d", what, error.status, extra={"fields": fields})


def access_line(logger: logging.Logger, ex: Exchange, outcome: Outcome) -> None:
    """One line per request, made after it ended: who, what, how it went and where the time went."""
    total = outcome.total_ms if outcome.total_ms > 0 else (time.perf_counter() - ex.started) * 1000.0
    status = outcome.status or 499  # the client left before the head
    fields = {
        "request_id": ex.request_id,
        "tenant": ex.tenant,
        "model": ex.model,
        "served_model": ex.served.model if ex.served is not None else None,
        "stream": ex.stream,
        "status": status,
        "ttft_ms": round(outcome.ttft_ms, 3) if outcome.ttft_ms is not None else None,
        "total_ms": round(total, 3),
        "overhead_ms": round(ex.overhead_ms, 3),
        "fallback": ex.fallback,
        "rejected_by": ex.rejected_by,
        "error": outcome.error,
        **ex.labels,  # what plugins report of the request (the cache's result)
        **ex.attributes,  # and what they add to its span (the entry a semantic hit replayed, its similarity)
    }
    logger.info("%s %d", ex.endpoint, status, extra={"fields": fields})
