"""OTLP/HTTP span export with a lean encoder: finished spans to the protobuf bytes of an ExportTraceServiceRequest.

The SDK's OTLP exporter builds a protobuf message object per span, attribute and value and then serialises
the tree: about 11 us a span measured here, in the export thread, holding the GIL the event loop needs. This
writes the same bytes directly (protobuf's wire format is five rules), about a quarter of that, and hands
them to the SDK's own HTTP client, which keeps its retries, back-off, compression, TLS and OTEL_EXPORTER_*
settings. The output is checked against the SDK's encoder field by field in tests/unit/gateway/test_otlp.py.

Messages, from opentelemetry/proto (field numbers in brackets):
    ExportTraceServiceRequest  resource_spans[1]
    ResourceSpans              resource[1] scope_spans[2] schema_url[3]
    Resource                   attributes[1]
    ScopeSpans                 scope[1] spans[2] schema_url[3]
    InstrumentationScope       name[1] version[2]
    Span                       trace_id[1] span_id[2] trace_state[3] parent_span_id[4] name[5] kind[6]
                               start_time_unix_nano[7] end_time_unix_nano[8] attributes[9] events[11]
                               status[15] flags[16]
    Event                      time_unix_nano[1] name[2] attributes[3]
    Status                     message[2] code[3]
    KeyValue                   key[1] value[2]
    AnyValue                   string[1] bool[2] int[3] double[4] array[5]
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanKind, Status, StatusCode

log = logging.getLogger("sluice.tracing")

FIXED64 = struct.Struct("<Q")
DOUBLE = struct.Struct("<d")
# Span.flags: the parent's is_remote is known (always, here), and whether it is remote.
HAS_IS_REMOTE = 0x100
IS_REMOTE = 0x200
# Tags: (field << 3) | wire type (0 varint, 1 fixed64, 2 length-delimited, 5 fixed32).
TRACE_ID, SPAN_ID, TRACE_STATE, PARENT_ID, NAME, KIND = b"\x0a", b"\x12", b"\x1a", b"\x22", b"\x2a", b"\x30"
START, END, ATTRIBUTE, EVENT, STATUS, FLAGS = b"\x39", b"\x41", b"\x4a", b"\x5a", b"\x7a", b"\x85\x01"


SMALL = [bytes((i,)) for i in range(0x80)]  # one-byte varints: most lengths and values
TIMES = struct.Struct("<cQcQ")  # start_time_unix_nano and end_time_unix_nano, tags included
# Span.kind by SpanKind's value (the proto's enum has UNSPECIFIED at 0), and Span.flags by the parent's remoteness.
KINDS = [KIND + bytes((value + 1,)) for value in range(len(SpanKind))]
LOCAL_FLAGS = FLAGS + HAS_IS_REMOTE.to_bytes(4, "little")
REMOTE_FLAGS = FLAGS + (HAS_IS_REMOTE | IS_REMOTE).to_bytes(4, "little")
# Encoded attributes and names kept for reuse: most repeat from request to request (the method, route, model,
# tenant, status, backend), so they are encoded once. Values seen once (ids, timings) stop being kept at this
# many; what was kept by then stays.
MEMO_SIZE = 4096
UNSET = Status(StatusCode.UNSET)  # the status of most spans: encoded without reading it
# Span.status without a message, by StatusCode's value.
STATUSES = [STATUS + (bytes((2, 0x18, code)) if code else b"\x00") for code in range(3)]


def varint(value: int) -> bytes:
    if 0 <= value < 0x80:
        return SMALL[value]
    if value < 0:
        value += 1 << 64  # int64 as two's complement: ten bytes
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field."""
    size = len(payload)
    return tag + (SMALL[size] if size < 0x80 else varint(size)) + payload


def any_value(value: Any) -> bytes:
    """An AnyValue message, as the SDK encodes the attribute types it accepts."""
    if isinstance(value, bool):  # before int: a bool is an int
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return field(b"\x0a", value.encode())
    if isinstance(value, int):
        if not -(1 << 63) <= value < 1 << 63:
            raise OverflowError("attribute value out of int64's range")
        return b"\x18" + varint(value)
    if isinstance(value, float):
        return b"\x21" + DOUBLE.pack(value)
    if isinstance(value, bytes):
        return field(b"\x3a", value)
    if isinstance(value, Sequence):
        return field(b"\x2a", b"".join(field(b"\x0a", any_value(item)) for item in value))
    raise TypeError(f"attribute value of type {type(value).__name__}")


class Encoder:
    """Spans of one resource and instrumentation scope to request bytes; attribute keys encoded once each."""

    def __init__(self, resource: Resource, scope: InstrumentationScope) -> None:
        self.keys: dict[str, bytes] = {}
        self.memo: dict[tuple[bytes, str, type, Any], bytes] = {}
        self.names: dict[str, bytes] = {}
        self.trace: tuple[int, bytes] = (0, b"")  # the last trace id, as the field that starts its spans
        self.resource = field(b"\x0a", self.attributes(b"\x0a", resource.attributes))
        scope_fields = field(b"\x0a", scope.name.encode())
        if scope.version:
            scope_fields += field(b"\x12", scope.version.encode())
        self.scope = field(b"\x0a", scope_fields)
        self.resource_schema = field(b"\x1a", resource.schema_url.encode()) if resource.schema_url else b""
        self.scope_schema = field(b"\x1a", scope.schema_url.encode()) if scope.schema_url else b""

    def attributes(self, tag: bytes, attributes: Mapping[str, Any] | None) -> bytes:
        if not attributes:
            return b""
        memo = self.memo
        parts = []
        for key, value in attributes.items():
            # The type is part of the key: True == 1 == 1.0, but each is encoded as its own type.
            seen = (tag, key, value.__class__, value)
            try:
                encoded = memo.get(seen)
                keep = True
            except TypeError:  # an unhashable value (a list): encoded every time
                encoded, keep = None, False
            if encoded is None:
                name = self.keys.get(key)
                if name is None:
                    name = self.keys[key] = field(b"\x0a", key.encode())
                encoded = field(tag, name + field(b"\x12", any_value(value)))
                if keep and len(memo) < MEMO_SIZE:
                    memo[seen] = encoded
            parts.append(encoded)
        return b"".join(parts)

    def span(self, span: ReadableSpan) -> bytes:
        """One Span message's fields (without its own tag and length)."""
        context = span.context
        assert context is not None  # a finished span always has one
        parent = span.parent
        return self.encode(
            context.trace_id,
            context.span_id,
            (parent.span_id, parent.is_remote) if parent is not None else None,
            span.name,
            span.kind,
            span.start_time or 0,
            span.end_time or 0,
            span.attributes,
            span.events,
            span.status,
            context.trace_state.to_header() if context.trace_state else "",
        )

    def encode(
        self,
        trace_id: int,
        span_id: int,
        parent: tuple[int, bool] | None,
        name: str,
        kind: SpanKind,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any] | None,
        events: Sequence[Event],
        status: Status,
        trace_state: str = "",
    ) -> bytes:
        """A Span message's fields from what a finished span holds, with no span object made for it.

        `parent` is the parent's (span id, whether it is remote)."""
        if self.trace[0] != trace_id:  # the spans of one trace come together
            self.trace = (trace_id, TRACE_ID + b"\x10" + trace_id.to_bytes(16, "big"))
        parts = [self.trace[1], SPAN_ID + b"\x08" + span_id.to_bytes(8, "big")]
        if trace_state:
            parts.append(field(TRACE_STATE, trace_state.encode()))
        if parent is not None:
            parts.append(PARENT_ID + b"\x08" + parent[0].to_bytes(8, "big"))
        named = self.names.get(name)
        if named is None:
            named = field(NAME, name.encode())
            if len(self.names) < MEMO_SIZE:
                self.names[name] = named
        parts += (named, KINDS[kind._value_], TIMES.pack(START, start_ns, END, end_ns))
        if attributes:
            parts.append(self.attributes(ATTRIBUTE, attributes))
        for event in events:
            body = b"\x09" + FIXED64.pack(event.timestamp) + field(b"\x12", event.name.encode())
            parts.append(field(EVENT, body + self.attributes(b"\x1a", event.attributes)))
        if status is UNSET:
            parts.append(STATUSES[0])
        else:
            code = status.status_code._value_
            if status.description:
                body = field(b"\x12", status.description.encode()) + (b"\x18" + varint(code) if code else b"")
                parts.append(field(STATUS, body))
            else:
                parts.append(STATUSES[code])
        parts.append(REMOTE_FLAGS if parent is not None and parent[1] else LOCAL_FLAGS)
        return b"".join(parts)

    def request(self, spans: Sequence[bytes]) -> bytes:
        """An ExportTraceServiceRequest holding `spans` (each from `span`) under the one resource and scope."""
        scope_spans = field(
            b"\x12", self.scope + b"".join([field(b"\x12", span) for span in spans]) + self.scope_schema
        )
        return field(b"\x0a", self.resource + scope_spans + self.resource_schema)


class LeanOTLPSpanExporter(OTLPSpanExporter):
    """The SDK's OTLP/HTTP exporter with the encoder above; spans of another resource or scope (none here) and
    an SDK whose HTTP client this does not know go through the SDK's own encoder instead."""

    def __init__(self, resource: Resource, scope: InstrumentationScope, endpoint: str | None = None) -> None:
        super().__init__(endpoint=endpoint)
        self.encoder = Encoder(resource, scope)
        self.resource = resource
        self.scope = scope
        client = getattr(self, "_client", None)
        self.lean = callable(getattr(client, "export", None))
        if not self.lean:
            log.debug("this OpenTelemetry SDK's exporter has no known HTTP client: spans use its own encoder")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not self.lean or any(
            s.resource is not self.resource or s.instrumentation_scope is not self.scope for s in spans
        ):
            return super().export(spans)
        if self._shutdown:
            return SpanExportResult.FAILURE
        encode = self.encoder.span
        try:
            data = self.encoder.request([encode(span) for span in spans])
        except (TypeError, ValueError, OverflowError):
            return super().export(spans)  # an attribute the lean encoder does not know: the SDK's rules
        return SpanExportResult.SUCCESS if self._client.export(data).success else SpanExportResult.FAILURE

    def send(self, spans: Sequence[bytes]) -> bool:
        """Spans encoded by `encoder.encode`, in one request through the SDK's client (its retries, back-off,
        compression, TLS and headers); True if the collector took them."""
        if self._shutdown:
            return False
        return bool(self._client.export(self.encoder.request(spans)).success)
