"""Tracing: one trace per proxied request, built after the response has ended from the stage timings.

On the request path only the trace context is decided (`begin`): the trace id is continued from an incoming
`traceparent` or drawn at random, the id of the inference span is drawn, the sampling decision is taken
(parent-based, else TraceIdRatio on the trace id, exactly as the SDK's `ParentBased(TraceIdRatioBased)`
decides) and `ex.traceparent` is set, so that the upstream continues the same trace under the inference span.
Nothing else happens until the completion task, where `record` lays the spans out on the perf_counter stage
timings, already ended. Over OTLP/HTTP (the default) each span is encoded to protobuf as it is laid out and
the bytes wait in a bounded queue that one thread sends in batches (span_queue.py); to Zipkin's v2 JSON API
(`telemetry.exporter: zipkin`) they are the SDK's span objects, exported by its BatchSpanProcessor.

    POST /v1/chat/completions       SERVER  arrival -> last byte
    |-- parse, auth, cache, ...             one per stage in ex.timings, back to back
    `-- chat chat-large             CLIENT  the upstream call: first try -> last byte (the upstream's parent)
        |-- upstream                        waiting for the head (and first chunk), every try included
        |   `-- attempt <model>             one per try, when there was more than one
        `-- stream                          head -> last byte, with a `first_token` event

A reply made by a plugin (a cache hit) has no inference span; its `stream`, if any, hangs off the root.

Spans are made as finished `ReadableSpan`s instead of being started and ended through a Tracer: the SDK's
live-span machinery (sampler, id generator, locks, attribute checks) costs about 50 us a span measured here,
the finished object about 2 us, and every fact a span needs is known by then. A collector that is down or
slow costs the request path nothing: the queue is bounded, and a trace that does not fit whole is dropped
whole, counted, and not even built.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from gateway.telemetry.otlp import Encoder, LeanOTLPSpanExporter
from gateway.telemetry.span_queue import SpanQueue
from gateway.telemetry.spans import Layout
from gateway.telemetry.tracecontext import incoming

if TYPE_CHECKING:
    from gateway.context import Exchange, Target
    from gateway.plugin import Outcome
    from gateway.settings import Settings, TelemetrySettings

log = logging.getLogger("sluice.tracing")

LOW_64 = (1 << 64) - 1
SHUTDOWN_WAIT_S = 2.0
DEFAULT_QUEUE = 2048  # the SDK's defaults
DEFAULT_BATCH = 512
DEFAULT_DELAY_MS = 5000
SpanCounter = Callable[[str, int], None]


def traces_url(settings: TelemetrySettings) -> str | None:
    """The OTLP/HTTP traces URL: the per-signal variable verbatim, else the config's base URL + /v1/traces.

    None leaves it to the exporter, which reads OTEL_EXPORTER_OTLP_ENDPOINT the same way.
    """
    if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or not settings.otlp_endpoint:
        return None
    base = settings.otlp_endpoint.rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


def span_exporter(settings: TelemetrySettings, resource: Resource, scope: InstrumentationScope) -> SpanExporter:
    """The exporter the config names. Zipkin's is imported only when chosen, as the SDK is only with tracing on."""
    if settings.exporter == "zipkin":
        from opentelemetry.exporter.zipkin.json import ZipkinExporter

        return ZipkinExporter(endpoint=settings.zipkin_endpoint)
    return LeanOTLPSpanExporter(resource, scope, traces_url(settings))


class HashedResource(Resource):
    """The process's resource, hashed once: the OTLP encoder groups spans by resource and would serialise its
    attributes to hash it again for every span (a fifth of the export's CPU, measured here)."""

    def __init__(self, resource: Resource) -> None:
        super().__init__(resource.attributes, resource.schema_url)
        self._hash = super().__hash__()

    def __hash__(self) -> int:
        return self._hash


class CountingExporter(SpanExporter):
    """The span exporter, counting what it was handed (for the queue's room) and how each export went."""

    def __init__(self, inner: SpanExporter, count: SpanCounter) -> None:
        self.inner = inner
        self.count = count
        self.handed = 0  # written by the export thread only
        self.failing = False  # logged once when exports start failing, once when they work again

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.handed += len(spans)
        exported = self.attempt(lambda: self.inner.export(spans) is SpanExportResult.SUCCESS, len(spans))
        return SpanExportResult.SUCCESS if exported else SpanExportResult.FAILURE

    def send(self, spans: Sequence[bytes]) -> None:
        """Encoded spans (the span queue's batch) through the lean exporter, counted and logged the same way."""
        inner = self.inner
        assert isinstance(inner, LeanOTLPSpanExporter)
        self.attempt(lambda: inner.send(spans), len(spans))

    def attempt(self, export: Callable[[], bool], spans: int) -> bool:
        why = "the collector refused or did not answer"
        try:
            ok = export()
        except Exception as exc:
            log.debug("span export failed", exc_info=True)
            why = f"{type(exc).__name__}: {exc}"
            ok = False
        self.settle(ok, why, spans)
        return ok

    def settle(self, ok: bool, why: str, spans: int) -> None:
        if ok == self.failing:
            self.failing = not ok
            if ok:
                log.warning("trace collector recovered: spans are exported again")
            else:
                log.warning("trace collector failing (%s): spans are dropped and counted as export_failed", why)
        self.count("exported" if ok else "export_failed", spans)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def bsp_setting(name: str, default: int) -> int:
    """A positive integer OTEL_BSP_* variable, else the SDK's default."""
    try:
        setting = int(os.environ.get(name, "") or default)
    except ValueError:
        return default
    return setting if setting > 0 else default


def _package_version() -> str:
    try:
        return version("sluice")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0"


class Tracing:
    """The trace context on the request path, and the spans of finished requests."""

    def __init__(self, settings: Settings, count: SpanCounter, exporter: SpanExporter | None = None) -> None:
        telemetry = settings.telemetry
        self.bound = TraceIdRatioBased.get_bound_for_rate(telemetry.sample_ratio)
        self.count = count
        self.listen = (settings.listen.host, settings.listen.port)
        service = os.environ.get("OTEL_SERVICE_NAME") or telemetry.service_name
        attributes = {"service.name": service, "service.version": _package_version()}
        attributes["service.instance.id"] = uuid.uuid4().hex  # one per worker process
        self.resource = HashedResource(Resource.create(attributes))
        self.scope = InstrumentationScope("sluice", _package_version())
        inner = exporter or span_exporter(telemetry, self.resource, self.scope)
        self.exporter = CountingExporter(inner, count)
        # The queue's size is ours to know, to drop whole traces before it overflows.
        self.capacity = bsp_setting("OTEL_BSP_MAX_QUEUE_SIZE", DEFAULT_QUEUE)
        batch = min(bsp_setting("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", DEFAULT_BATCH), self.capacity)
        # OTLP with the lean encoder (the default): spans are encoded as they are laid out and only bytes are
        # queued (gateway/telemetry/span_queue.py). Any other exporter (Zipkin, one handed in) gets the SDK's span
        # objects through its BatchSpanProcessor, which reads OTEL_BSP_SCHEDULE_DELAY itself.
        self.encoder: Encoder | None = None
        self.queue: SpanQueue | None = None
        self.processor: BatchSpanProcessor | None = None
        if isinstance(inner, LeanOTLPSpanExporter) and inner.lean:
            self.encoder = inner.encoder
            delay_s = bsp_setting("OTEL_BSP_SCHEDULE_DELAY", DEFAULT_DELAY_MS) / 1000.0
            self.queue = SpanQueue(self.exporter.send, count, capacity=self.capacity, batch=batch, delay_s=delay_s)
        else:
            self.processor = BatchSpanProcessor(
                self.exporter, max_queue_size=self.capacity, max_export_batch_size=batch
            )
        self.submitted = 0
        self.servers: dict[str, tuple[str, int] | None] = {}

    # -- the request path ---------------------------------------------------------------------------------

    def begin(self, ex: Exchange) -> None:
        """Continue or start the trace; set the `traceparent` the upstream will get (the inference span's id)."""
        span_id = random.getrandbits(64) or 1
        # Most requests carry no traceparent: one dict lookup tells, and only one that does is parsed.
        found = incoming(ex.headers) if ex.header(b"traceparent") is not None else None
        if found is not None:
            trace_hex = found[1]
            sampled = int(found[3], 16) & 1
        else:
            trace_id = random.getrandbits(128) or 1
            trace_hex = b"%032x" % trace_id
            sampled = (trace_id & LOW_64) < self.bound
        ex.traceparent = b"00-%s-%016x-%s" % (trace_hex, span_id, b"01" if sampled else b"00")

    # -- the completion task ------------------------------------------------------------------------------

    def record(self, ex: Exchange, outcome: Outcome) -> str | None:
        """Export the request's spans if it was sampled; return its trace id (hex) then, else None."""
        traceparent = ex.traceparent
        if traceparent is None or not traceparent.endswith(b"-01"):
            return None
        trace_hex = traceparent[3:35].decode()
        layout = Layout(ex, outcome, int(traceparent[36:52], 16))
        # The collector is not keeping up: lose this trace, not the loop.
        if self.queue is not None:
            if not self.queue.room(layout.size):
                return None
        elif self.submitted + layout.size - self.exporter.handed > self.capacity:
            self.count("dropped", layout.size)
            return None
        found = incoming(ex.headers) if ex.header(b"traceparent") is not None else None
        remote = (int(found[2], 16), True) if found is not None else None
        try:
            made = layout.spans(int(trace_hex, 16), remote, self, time.time_ns(), time.perf_counter())
        except (TypeError, ValueError, OverflowError):  # an attribute OTLP cannot carry: a bug, not the client's
            log.exception("request %s: its trace could not be encoded", ex.request_id)
            self.count("dropped", layout.size)
            return None
        if self.queue is not None:
            self.queue.put(made.encoded)
        else:
            assert self.processor is not None
            for span in made.spans:
                self.processor.on_end(span)
            self.submitted += len(made.spans)
        return trace_hex

    def server(self, target: Target) -> tuple[str, int] | None:
        """server.address and server.port of a target's upstream, where it has one (not the simulated kind)."""
        if target.backend not in self.servers:
            url = target.provider.url
            parts = urlsplit(url) if url is not None else None
            self.servers[target.backend] = (
                (parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
                if parts is not None and parts.hostname
                else None
            )
        return self.servers[target.backend]

    def flush(self) -> None:
        """Export everything queued now, in the calling thread."""
        if self.queue is not None:
            self.queue.flush()
        elif self.processor is not None:
            self.processor.force_flush()

    def shutdown(self) -> None:
        """Flush what is queued, waiting at most SHUTDOWN_WAIT_S: a collector that is down must not hold up exit."""
        if self.queue is not None:
            self.queue.close(SHUTDOWN_WAIT_S)
            # Also aborts the exporter's retry back-off if the last batch is still trying; the daemon thread
            # ends with the process.
            self.exporter.shutdown()
            return
        assert self.processor is not None
        worker = threading.Thread(target=self.processor.shutdown, name="sluice-trace-shutdown", daemon=True)
        worker.start()
        worker.join(SHUTDOWN_WAIT_S)
        if worker.is_alive():
            # Aborts the exporter's retry back-off; the daemon threads end with the process.
            self.exporter.shutdown()
