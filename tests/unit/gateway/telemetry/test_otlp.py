"""The lean OTLP encoder against the SDK's: the same ExportTraceServiceRequest, field by field."""

from __future__ import annotations

import random

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from gateway.telemetry.otlp import Encoder, LeanOTLPSpanExporter, varint
from gateway.telemetry.tracing import HashedResource

SAMPLED = TraceFlags(TraceFlags.SAMPLED)
RESOURCE = HashedResource(Resource.create({"service.name": "sluice", "service.instance.id": "i" * 32}))
SCOPE = InstrumentationScope("sluice", "1.2.3")


def context(trace_id: int, remote: bool = False, state: TraceState | None = None) -> SpanContext:
    return SpanContext(trace_id, random.getrandbits(64) or 1, remote, SAMPLED, state)


def span(
    name: str,
    ctx: SpanContext,
    parent: SpanContext | None,
    attributes: dict[str, object] | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    status: Status | None = None,
    events: tuple[Event, ...] = (),
    resource: Resource = RESOURCE,
) -> ReadableSpan:
    start = 1_764_590_000_000_000_000 + random.getrandbits(20)
    return ReadableSpan(
        name,
        ctx,
        parent,
        resource,
        attributes or {},  # type: ignore[arg-type]
        events,
        (),
        kind,
        None,
        status or Status(StatusCode.UNSET),
        start,
        start + random.getrandbits(24),
        SCOPE,
    )


def trace() -> list[ReadableSpan]:
    """A trace with every feature the gateway's spans use, and some it does not."""
    trace_id = random.getrandbits(128) or 1
    remote = context(trace_id, remote=True, state=TraceState([("vendor", "value")]))
    root = context(trace_id)
    inference = context(trace_id)
    attributes = {
        "http.request.method": "POST",
        "server.port": 8080,
        "sluice.overhead_ms": 0.123,
        "gen_ai.request.stream": True,
        "sluice.client_gone": False,
        "negative": -5,
        "big": 2**62,
        "tags": ["a", "b"],
        "numbers": (1, 2, 3),
        "unicode": "héllo ✓",
        "long": "x" * 300,
    }
    events = (Event("first_token", {"sluice.ttft_ms": 1.5}, 1_764_590_000_000_500_000),)
    return [
        span("POST /v1/chat/completions", root, remote, attributes, SpanKind.SERVER),
        span("auth", context(trace_id), root),
        span(
            "chat m",
            inference,
            root,
            {"gen_ai.operation.name": "chat"},
            SpanKind.CLIENT,
            Status(StatusCode.ERROR, "upstream failed"),
        ),
        span("stream", context(trace_id), inference, {"sluice.chunks": 12}, events=events),
        span("ok", context(trace_id), inference, None, SpanKind.PRODUCER, Status(StatusCode.OK)),
        span("consumer", context(trace_id), None, None, SpanKind.CONSUMER),
    ]


def parsed(data: bytes) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    request.ParseFromString(data)
    return request


def test_the_encoding_is_the_sdks() -> None:
    spans = [s for _ in range(20) for s in trace()]
    encoder = Encoder(RESOURCE, SCOPE)
    mine = encoder.request([encoder.span(s) for s in spans])
    expected = encode_spans(spans)
    assert parsed(mine) == expected
    assert len(mine) == len(expected.SerializeToString())


def test_a_schema_url_and_no_scope_version() -> None:
    resource = Resource({"service.name": "x"}, "https://opentelemetry.io/schemas/1.30.0")
    scope = InstrumentationScope("plain", None, "https://opentelemetry.io/schemas/1.29.0")
    one = ReadableSpan("s", context(7), None, resource, {}, (), (), SpanKind.INTERNAL, None, Status(StatusCode.UNSET),
                       1, 2, scope)  # fmt: skip
    encoder = Encoder(resource, scope)
    assert parsed(encoder.request([encoder.span(one)])) == encode_spans([one])


def test_varints() -> None:
    for value, encoded in ((0, b"\x00"), (1, b"\x01"), (127, b"\x7f"), (128, b"\x80\x01"), (300, b"\xac\x02")):
        assert varint(value) == encoded
    assert varint(-1) == b"\xff" * 9 + b"\x01"  # int64 -1: ten bytes


def test_an_attribute_the_encoder_does_not_know_is_refused() -> None:
    encoder = Encoder(RESOURCE, SCOPE)
    with pytest.raises(TypeError):
        encoder.span(span("odd", context(3), None, {"odd": {"a": 1}}))


def test_the_exporter_uses_the_lean_encoder_with_this_sdk() -> None:
    exporter = LeanOTLPSpanExporter(RESOURCE, SCOPE, "http://127.0.0.1:9/v1/traces")
    try:
        assert exporter.lean, "the installed SDK's exporter changed: spans would fall back to its own encoder"
    finally:
        typed: SpanExporter = exporter  # the SDK's override is untyped
        typed.shutdown()


def test_an_integer_beyond_int64_is_refused_as_the_sdk_refuses_it() -> None:
    encoder = Encoder(RESOURCE, SCOPE)
    with pytest.raises(OverflowError):
        encoder.span(span("big", context(3), None, {"big": 1 << 63}))
