"""The shape of one request's trace: its spans laid out on the stage timings, made as finished spans.

Offsets are milliseconds since the request arrived, taken from the perf_counter timings the pipeline keeps
(`ex.timings`, `ex.upstream_ms`, `ex.overhead_ms`, the outcome's TTFT and total); they are placed on the wall
clock once, from one clock reading made when the spans are built. Stages are laid end to end in the order
they ran, so every span lies within the root and the durations are the numbers of `server-timing`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from gateway.telemetry.otlp import UNSET

if TYPE_CHECKING:
    from gateway.context import Exchange
    from gateway.plugin import Outcome
    from gateway.telemetry.tracing import Tracing

SAMPLED = TraceFlags(TraceFlags.SAMPLED)
# A span's parent as the spans under it need it: (span id, whether it is remote).
Parent = tuple[int, bool]
OPERATIONS = {
    "chat/completions": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
    "responses": "chat",
    "messages": "chat",  # Anthropic's Messages API
}
ROUTES = {endpoint: f"/v1/{endpoint}" for endpoint in (*OPERATIONS, "messages/count_tokens")}
# Request fields recorded on the inference span (GenAI conventions, "recommended").
REQUEST_FIELDS = (
    ("max_tokens", "gen_ai.request.max_tokens"),
    ("max_completion_tokens", "gen_ai.request.max_tokens"),
    ("max_output_tokens", "gen_ai.request.max_tokens"),
    ("temperature", "gen_ai.request.temperature"),
    ("top_p", "gen_ai.request.top_p"),
    ("seed", "gen_ai.request.seed"),
    ("frequency_penalty", "gen_ai.request.frequency_penalty"),
    ("presence_penalty", "gen_ai.request.presence_penalty"),
)


class Layout:
    """Where each span of one request starts and ends, in ms from its arrival (perf_counter based)."""

    __slots__ = ("client_id", "end", "ex", "head", "outcome", "pool", "size", "stages", "upstream")

    def __init__(self, ex: Exchange, outcome: Outcome, client_id: int) -> None:
        self.ex = ex
        self.outcome = outcome
        self.client_id = client_id
        self.stages: list[tuple[str, float, float]] = []
        self.upstream: tuple[float, float] | None = None
        self.pool: tuple[float, float] | None = None  # getting a connection: the start of the upstream wait
        at = 0.0
        for stage, ms in ex.timings:
            if stage == "pool":
                self.pool = (at, at + ms)
            elif stage == "upstream":
                self.upstream = (self.pool[0] if self.pool is not None else at, at + ms)
            else:
                self.stages.append((stage, at, at + ms))
            at += ms
        # The head went out overhead + upstream wait after arrival; 0 overhead means it never did.
        self.head = ex.overhead_ms + ex.upstream_ms if ex.overhead_ms > 0 else None
        self.end = max(outcome.total_ms, at, self.head or 0.0)
        size = 1 + len(self.stages)
        if self.upstream is not None:
            size += 2 + (len(ex.attempts) if len(ex.attempts) > 1 else 0) + (self.pool is not None)
        if self.head is not None and ex.stream and outcome.status < 400:
            size += 1
        self.size = size

    def spans(self, trace_id: int, remote: Parent | None, tracing: Tracing, wall_ns: int, perf: float) -> Spans:
        ex, outcome = self.ex, self.outcome
        if outcome.total_ms <= 0:  # the client left mid-way: the request ended when the task did
            self.end = max(self.end, (perf - ex.started) * 1000.0)
        made = Spans(trace_id, wall_ns - int((perf - ex.started) * 1e9), tracing)
        root_attributes = self.root_attributes(tracing)
        root = made.add(
            f"POST {root_attributes['http.route']}",
            remote,
            0.0,
            self.end,
            root_attributes,
            SpanKind.SERVER,
            Status(StatusCode.ERROR, outcome.error) if outcome.status >= 500 else UNSET,
        )
        for stage, start, end in self.stages:
            made.add(stage, root, start, end, route_attributes(ex) if stage == "route" else None)
        stream_parent = root
        if self.upstream is not None:
            start, waited = self.upstream
            attributes = self.inference_attributes(tracing, start)
            error = attributes.get("error.type")
            stream_parent = made.add(
                f"{attributes['gen_ai.operation.name']} {ex.model}",
                root,
                start,
                self.end,
                attributes,
                SpanKind.CLIENT,
                Status(StatusCode.ERROR, outcome.error or error) if error and error != "cancelled" else UNSET,
                span_id=self.client_id,
            )
            wait = made.add("upstream", stream_parent, start, waited, {"sluice.attempts": len(ex.attempts)})
            if self.pool is not None:
                made.add("pool", wait, *self.pool)
            if len(ex.attempts) > 1:
                at = start
                for model, ms, status in ex.attempts:
                    done = min(at + ms, waited)
                    tried: dict[str, Any] = {"sluice.model": model}
                    if status:
                        tried["error.type"] = str(status)
                    made.add(f"attempt {model}", wait, at, done, tried)
                    at = done
        if self.head is not None and ex.stream and outcome.status < 400:
            events = []
            if outcome.ttft_ms is not None:
                events.append(Event("first_token", {"sluice.ttft_ms": outcome.ttft_ms}, made.ns(outcome.ttft_ms)))
            made.add("stream", stream_parent, self.head, self.end, {"sluice.chunks": outcome.chunks}, events=events)
        return made

    def root_attributes(self, tracing: Tracing) -> dict[str, Any]:
        ex, outcome = self.ex, self.outcome
        host, port = tracing.listen
        attributes: dict[str, Any] = {
            "http.request.method": ex.method.decode(),
            "http.route": ROUTES.get(ex.endpoint, "/" + ex.endpoint) + ("/{id}" if ex.resource else ""),
            "url.path": ROUTES.get(ex.endpoint, "/" + ex.endpoint),
            "url.scheme": "http",
            "network.protocol.version": "1.1",
            "server.address": host,
            "server.port": port,
            "sluice.request_id": ex.request_id,
            "sluice.tenant": ex.tenant,
            "sluice.model": ex.model,
            "sluice.source": outcome.source,
            "sluice.overhead_ms": ex.overhead_ms,
        }
        if outcome.status:
            attributes["http.response.status_code"] = outcome.status
            if outcome.status >= 500:
                attributes["error.type"] = str(outcome.status)
        agent = ex.header(b"user-agent")
        if agent:
            attributes["user_agent.original"] = agent.decode("latin-1")
        if ex.served is not None:
            attributes["sluice.served_model"] = ex.served.model
            attributes["sluice.backend"] = ex.served.backend
        if ex.fallback is not None:
            attributes["sluice.fallback"] = ex.fallback
        if ex.rejected_by is not None:
            attributes["sluice.rejected_by"] = ex.rejected_by
        for label, value in ex.labels.items():  # what plugins reported, as they declared it
            attributes[f"sluice.{label}"] = value
        attributes.update(ex.attributes)
        if outcome.ttft_ms is not None:
            attributes["sluice.ttft_ms"] = outcome.ttft_ms
        if outcome.tpot_ms is not None:
            attributes["sluice.tpot_ms"] = outcome.tpot_ms
        if outcome.client_gone:
            attributes["sluice.client_gone"] = True
        if outcome.error is not None:
            attributes["sluice.error"] = outcome.error
        return attributes

    def inference_attributes(self, tracing: Tracing, start: float) -> dict[str, Any]:
        ex, outcome = self.ex, self.outcome
        target = ex.served or (ex.targets[0] if ex.targets else None)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": OPERATIONS.get(ex.endpoint, ex.endpoint),
            "gen_ai.request.model": ex.model,
            "gen_ai.request.stream": ex.stream,
            "sluice.tenant": ex.tenant,
        }
        if target is not None:
            attributes["gen_ai.provider.name"] = target.provider.system
            server = tracing.server(target)
            if ex.routed is not None:  # the replica the backend's route policy chose
                host, _, port = ex.routed[0].rpartition(":")
                server = (host.strip("[]"), int(port))
            if server is not None:
                attributes["server.address"], attributes["server.port"] = server
        if ex.served is not None:
            # The model that answered, after any fallback; the upstream's own dated id is not parsed out of
            # the body, to keep the relay free of JSON parsing.
            attributes["gen_ai.response.model"] = ex.served.upstream_model
        for field, name in REQUEST_FIELDS:
            value = ex.json.get(field)
            if isinstance(value, int | float) and not isinstance(value, bool):
                attributes[name] = value
        usage = outcome.usage
        if usage is not None:
            for field, name in (("prompt_tokens", "gen_ai.usage.input_tokens"),
                                ("completion_tokens", "gen_ai.usage.output_tokens")):  # fmt: skip
                value = usage.get(field)
                if isinstance(value, int):
                    attributes[name] = value
            attributes["sluice.usage_source"] = outcome.usage_source
        if outcome.ttft_ms is not None and ex.stream:
            attributes["gen_ai.response.time_to_first_chunk"] = max(outcome.ttft_ms - start, 0.0) / 1000.0
        error = error_type(outcome)
        if error is None and ex.served is None:
            # Every target failed and a plugin answered anyway (a stale cache entry): the call still failed.
            error = str(ex.attempts[-1][2]) if ex.attempts else "_OTHER"
        if error is not None:
            attributes["error.type"] = error
        return attributes


class Spans:
    """The finished spans of one trace, placed on the wall clock from ms offsets since the request's arrival:
    encoded for OTLP as they are made when tracing has the lean encoder, else as the SDK's span objects."""

    __slots__ = ("anchor", "encoded", "encoder", "resource", "scope", "spans", "trace_id")

    def __init__(self, trace_id: int, anchor_ns: int, tracing: Tracing) -> None:
        self.trace_id = trace_id
        self.anchor = anchor_ns
        self.resource = tracing.resource
        self.scope = tracing.scope
        self.encoder = tracing.encoder
        self.spans: list[ReadableSpan] = []
        self.encoded: list[bytes] = []

    def ns(self, ms: float) -> int:
        return self.anchor + int(ms * 1e6)

    def add(
        self,
        name: str,
        parent: Parent | None,
        start: float,
        end: float,
        attributes: dict[str, Any] | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        status: Status = UNSET,
        events: Sequence[Event] = (),
        span_id: int = 0,
    ) -> Parent:
        """Add a finished span; return what the spans under it need of it."""
        span_id = span_id or random.getrandbits(64) or 1
        if self.encoder is not None:
            self.encoded.append(
                self.encoder.encode(
                    self.trace_id, span_id, parent, name, kind, self.ns(start), self.ns(end), attributes, events, status
                )
            )
            return span_id, False
        trace_id = self.trace_id
        self.spans.append(
            ReadableSpan(
                name,
                SpanContext(trace_id, span_id, False, SAMPLED),
                SpanContext(trace_id, parent[0], parent[1], SAMPLED) if parent is not None else None,
                self.resource,
                attributes or {},
                events,
                (),
                kind,
                None,
                status,
                self.ns(start),
                self.ns(end),
                self.scope,
            )
        )
        return span_id, False


def error_type(outcome: Outcome) -> str | None:
    """A low-cardinality `error.type` for the upstream call, or None when it succeeded."""
    if outcome.status >= 400:
        return str(outcome.status)
    if outcome.client_gone:
        return "cancelled"
    if outcome.error is not None:
        return "stream_interrupted"
    return None


def route_attributes(ex: Exchange) -> dict[str, Any] | None:
    """The endpoint a backend's route policy chose, for the `route` span."""
    if ex.routed is None:
        return None
    endpoint, policy, score = ex.routed
    return {"sluice.endpoint": endpoint, "sluice.route.policy": policy, "sluice.route.score": score}
