"""Where the time went: stage timings to a Server-Timing header, Prometheus metrics and OTel traces.

Stage timings are taken with perf_counter on the request path; everything built from them is built once per
request, after the response has ended, in the pipeline's completion task. The request path itself pays for
two things only: the in-flight gauge, and (with tracing on) the trace context that goes upstream.

Tracing is decided once at start-up (`tracing.enabled`): with nowhere to send spans the OpenTelemetry SDK is
not even imported, and an incoming `traceparent` is passed upstream unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gateway.plugin import schema_of
from gateway.telemetry import metric_files, tracecontext
from gateway.telemetry.console import Entry, Ring
from gateway.telemetry.console_peers import Peers, select
from gateway.telemetry.metrics import Meter, Metrics

if TYPE_CHECKING:
    from gateway.context import Exchange
    from gateway.plugin import Outcome, Plugin
    from gateway.settings import Settings
    from gateway.state.store import Store
    from gateway.telemetry.tracing import Tracing
    from gateway.upstream.attempts import Upstreams

log = logging.getLogger("sluice.telemetry")


class Telemetry:
    """One per process: metrics always, tracing when there is a collector to send spans to."""

    def __init__(
        self, settings: Settings, plugins: list[Plugin], store: Store | None = None, upstreams: Upstreams | None = None
    ) -> None:
        self.settings = settings
        labels = {name: default for plugin in plugins for name, default in schema_of(type(plugin)).labels.items()}
        backends = {name: p.health for name, p in upstreams.providers.items()} if upstreams is not None else None
        self.metrics = Metrics(settings.telemetry, settings.tenants, labels, store, backends)
        self.meter = Meter(self.metrics)
        self.tracing_enabled = tracecontext.enabled(settings.telemetry)
        self.tracing: Tracing | None = None
        console = settings.admin.console
        self.ring = Ring(console.requests, console.max_bytes) if console.enabled else None
        self.peers: Peers | None = None  # with several workers: how the console reaches the others' rings

    async def start(self) -> None:
        """Start the span export thread: per process, after any fork, as the SDK advises; and metrics sharing."""
        await self.metrics.start()
        shared = metric_files.directory()
        if self.ring is not None and shared and self.peers is None:
            self.peers = Peers(self.ring, shared)
            await self.peers.start()
        if self.tracing_enabled and self.tracing is None:
            from gateway.telemetry.tracing import Tracing  # the OpenTelemetry SDK is imported only when tracing is on

            self.tracing = Tracing(self.settings, self.metrics.count_spans)

    # -- the request path ---------------------------------------------------------------------------------

    def begin(self, ex: Exchange) -> None:
        """The request is routed and about to be served: count it in flight, set its upstream trace context."""
        self.metrics.begin(ex)
        if self.tracing is not None:
            self.tracing.begin(ex)
        else:
            tracecontext.forward(ex)

    # -- the completion task ------------------------------------------------------------------------------

    def complete(self, ex: Exchange, outcome: Outcome) -> None:
        trace_id = self.tracing.record(ex, outcome) if self.tracing is not None else None
        total_ms = outcome.total_ms if outcome.total_ms > 0 else (time.perf_counter() - ex.started) * 1000.0
        self.metrics.record(ex, outcome, total_ms, trace_id)
        ring = self.ring
        if ring is not None:  # the console's memory: the fields written into its columns (telemetry/console.py)
            ring.record(ex, outcome, total_ms)

    def rejected(self, status: int) -> None:
        """A request refused before it was routed (bad JSON, unknown model, too large): counted, not traced."""
        self.metrics.rejected(status)

    async def recent(self, question: Mapping[str, Any]) -> list[Entry]:
        """The console's entries for a question (telemetry/console_peers.py): this process's, and with several
        workers every live worker's."""
        assert self.ring is not None
        if self.peers is not None:
            return await self.peers.gather(question)
        return await asyncio.to_thread(select, self.ring.snapshot(), question)

    async def exposition(self, accept: str) -> tuple[bytes, str]:
        """A scrape: with several workers, the others are first asked for their values (telemetry/metric_files.py)."""
        await self.metrics.gather()
        return self.metrics.exposition(accept)

    def close(self) -> None:
        if self.peers is not None:
            self.peers.close()
            self.peers = None
        if self.tracing is not None:
            self.tracing.shutdown()
            self.tracing = None
        self.metrics.close()
