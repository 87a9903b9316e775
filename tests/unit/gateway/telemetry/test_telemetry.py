"""Telemetry pieces on built Exchanges: trace context, span layout, metrics series, labels and exposition."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanMessage
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import parse
from gateway.context import Exchange
from gateway.plugin import BUILTIN, Configured, Outcome, load_class, schema_of
from gateway.runtime import Runtime
from gateway.settings import Settings, TelemetrySettings
from gateway.state.store import Store
from gateway.telemetry import tracecontext
from gateway.telemetry.durations import ms_text, ms_value, server_timing
from gateway.telemetry.metrics import Metrics, TenantLabels
from gateway.telemetry.otlp import LeanOTLPSpanExporter
from gateway.telemetry.span_queue import SpanQueue
from gateway.telemetry.tracing import Tracing, traces_url
from gateway.upstream.attempts import Upstreams
from tests.support.gateway import free_port

CONFIG = """
listen: {host: 127.0.0.1, port: 8080}
backends:
  sim: {type: simulated}
  up: {type: openai, base_url: "http://10.1.2.3:8000/v1"}
models:
  chat-large: {backend: up, upstream_model: large, fallback: [chat-small]}
  chat-small: {backend: sim, upstream_model: small}
tenants:
  acme: {}
telemetry: {otlp_endpoint: "http://collector:4318", service_name: sluice-test, sample_ratio: 1.0}
"""
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.fixture(autouse=True)
def no_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)


@pytest.fixture()
def settings() -> Settings:
    return parse(CONFIG)


@pytest.fixture()
def upstreams(settings: Settings) -> Upstreams:
    return Upstreams(settings)


class Fates:
    """The span counter handed to Tracing: what became of how many spans."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def __call__(self, result: str, count: int) -> None:
        self.counts[result] = self.counts.get(result, 0) + count


@pytest.fixture()
def traced(settings: Settings) -> Iterator[tuple[Tracing, InMemorySpanExporter, Fates]]:
    memory = InMemorySpanExporter()
    fates = Fates()
    tracing = Tracing(settings, fates, exporter=memory)
    yield tracing, memory, fates
    tracing.shutdown()


def exchange(
    upstreams: Upstreams,
    *,
    model: str = "chat-large",
    stream: bool = True,
    headers: list[tuple[bytes, bytes]] | None = None,
    json: dict[str, Any] | None = None,
) -> Exchange:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream, **(json or {})}
    ex = Exchange("rid-1", "chat/completions", headers or [], b"{}", body, time.perf_counter() - 0.2)
    ex.targets = list(upstreams.chains[model])
    ex.tenant = "acme"
    return ex


def served(ex: Exchange, upstreams: Upstreams, model: str = "chat-large") -> None:
    """The stage timings and upstream facts of a request that `model` served: 200 ms in all."""
    ex.timings = [("parse", 0.1), ("auth", 0.05), ("cache", 0.2), ("upstream", 50.0)]
    ex.upstream_ms = 50.0
    ex.overhead_ms = 0.5
    ex.served = upstreams.targets[model]
    ex.attempts = [(model, 50.0, 0)]
    ex.labels["cache"] = "miss"  # as the cache plugin reports a miss


def finished(stream: bool = True) -> Outcome:
    usage = {"prompt_tokens": 7, "completion_tokens": 11, "total_tokens": 18}
    return Outcome(status=200, complete=True, ttft_ms=80.0, tpot_ms=10.0, total_ms=200.0, chunks=14, usage=usage)


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    named = {span.name: span for span in spans}
    assert len(named) == len(spans), [span.name for span in spans]
    return named


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def span_id(span: ReadableSpan) -> int:
    context = span.get_span_context()
    assert context is not None
    return context.span_id


# -- trace context ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        (f"00-{TRACE}-{PARENT}-01", True),
        (f"00-{TRACE}-{PARENT}-00", True),
        (f"01-{TRACE}-{PARENT}-01-future", True),  # later versions may append fields
        (f"00-{TRACE}-{PARENT}-01-extra", False),  # version 00 may not
        (f"ff-{TRACE}-{PARENT}-01", False),
        (f"00-{TRACE.upper()}-{PARENT}-01", False),
        (f"00-{'0' * 32}-{PARENT}-01", False),
        (f"00-{TRACE}-{'0' * 16}-01", False),
        (f"00-{TRACE}-{PARENT}", False),
        (f"0-0{TRACE}-{PARENT}-01", False),  # three dashes, one out of place
        (f"00-{TRACE[:-1]}-{PARENT}-01x", False),
        (f"01-{TRACE}-{PARENT}-01x", False),  # a later version's fields follow a dash
        (f"00-{TRACE}-{PARENT}-0g", False),
        (f" 00-{TRACE}-{PARENT}-01 ", True),  # surrounding whitespace is not the value's
        ("garbage", False),
    ],
)
def test_incoming_traceparent(value: str, valid: bool) -> None:
    found = tracecontext.incoming([(b"traceparent", value.encode())])
    assert (found is not None) is valid


def test_tracing_is_on_only_with_somewhere_to_send_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not tracecontext.enabled(TelemetrySettings())
    assert tracecontext.enabled(TelemetrySettings(otlp_endpoint="http://c:4318"))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4318/v1/traces")
    assert tracecontext.enabled(TelemetrySettings())
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracecontext.enabled(TelemetrySettings(otlp_endpoint="http://c:4318"))


def test_traces_url(monkeypatch: pytest.MonkeyPatch) -> None:
    assert traces_url(TelemetrySettings(otlp_endpoint="http://c:4318/")) == "http://c:4318/v1/traces"
    assert traces_url(TelemetrySettings(otlp_endpoint="http://c:4318/v1/traces")) == "http://c:4318/v1/traces"
    assert traces_url(TelemetrySettings()) is None  # the exporter reads OTEL_EXPORTER_OTLP_ENDPOINT itself
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://other:4318/v1/traces")
    assert traces_url(TelemetrySettings(otlp_endpoint="http://c:4318")) is None  # the per-signal variable wins


def test_tracing_off_forwards_the_clients_traceparent(upstreams: Upstreams) -> None:
    value = f"00-{TRACE}-{PARENT}-01".encode()
    ex = exchange(upstreams, headers=[(b"traceparent", value)])
    tracecontext.forward(ex)
    assert ex.traceparent == value
    ex = exchange(upstreams, headers=[(b"traceparent", b"nonsense")])
    tracecontext.forward(ex)
    assert ex.traceparent is None
    # A later version is read for its four fields and goes on as version 00: never the client's bytes.
    ex = exchange(upstreams, headers=[(b"traceparent", f"01-{TRACE}-{PARENT}-01-{'x' * 8192}".encode())])
    tracecontext.forward(ex)
    assert ex.traceparent == value


def test_begin_starts_a_trace(traced: tuple[Tracing, InMemorySpanExporter, Fates], upstreams: Upstreams) -> None:
    tracing, _, _ = traced
    ex = exchange(upstreams)
    tracing.begin(ex)
    assert ex.traceparent is not None
    found = tracecontext.incoming([(b"traceparent", ex.traceparent)])
    assert found is not None
    assert found[0] == b"00"
    assert found[3] == b"01"
    other = exchange(upstreams)
    tracing.begin(other)
    assert other.traceparent is not None
    assert other.traceparent[3:35] != ex.traceparent[3:35]


def test_begin_continues_the_clients_trace(
    traced: tuple[Tracing, InMemorySpanExporter, Fates], upstreams: Upstreams
) -> None:
    tracing, _, _ = traced
    for flags in ("01", "00"):
        ex = exchange(upstreams, headers=[(b"traceparent", f"00-{TRACE}-{PARENT}-{flags}".encode())])
        tracing.begin(ex)
        assert ex.traceparent is not None
        trace, span, sent_flags = ex.traceparent.decode().split("-")[1:]
        assert (trace, sent_flags) == (TRACE, flags)
        assert span != PARENT  # the upstream's parent is our inference span, not the client's


def test_sampling_decisions_match_the_sdk_sampler(settings: Settings, upstreams: Upstreams) -> None:
    """The decision taken before the upstream call is the one ParentBased(TraceIdRatioBased) would take."""
    ratio = 0.3
    sampler = TraceIdRatioBased(ratio)
    tracing = Tracing(
        settings.model_copy(update={"telemetry": TelemetrySettings(sample_ratio=ratio)}),
        Fates(),
        exporter=InMemorySpanExporter(),
    )
    try:
        random.seed(7)
        sampled = 0
        for _ in range(2000):
            ex = exchange(upstreams)
            tracing.begin(ex)
            assert ex.traceparent is not None
            trace_id = int(ex.traceparent[3:35], 16)
            ours = ex.traceparent.endswith(b"-01")
            assert ours == sampler.should_sample(None, trace_id, "x").decision.is_sampled()
            sampled += ours
        assert 450 < sampled < 750
    finally:
        tracing.shutdown()


# -- spans ---------------------------------------------------------------------------------------------------


def test_spans_of_a_streamed_upstream_answer(
    traced: tuple[Tracing, InMemorySpanExporter, Fates], upstreams: Upstreams
) -> None:
    tracing, memory, fates = traced
    ex = exchange(upstreams, json={"temperature": 0, "max_tokens": 64}, headers=[(b"user-agent", b"OpenAI/Python")])
    tracing.begin(ex)
    served(ex, upstreams)
    assert ex.traceparent is not None
    trace_id = tracing.record(ex, finished())
    assert trace_id == ex.traceparent[3:35].decode()
    tracing.flush()
    spans = by_name(memory.get_finished_spans())
    assert set(spans) == {
        "POST /v1/chat/completions",
        "parse",
        "auth",
        "cache",
        "chat chat-large",
        "upstream",
        "stream",
    }
    assert fates.counts == {"exported": 7}

    root = spans["POST /v1/chat/completions"]
    client = spans["chat chat-large"]
    assert root.parent is None
    assert root.kind is SpanKind.SERVER
    assert client.kind is SpanKind.CLIENT
    assert span_id(client) == int(ex.traceparent[36:52], 16)  # the upstream's parent
    for name in ("parse", "auth", "cache", "chat chat-large"):
        assert parent_of(spans[name]) == span_id(root)
    assert parent_of(spans["upstream"]) == span_id(client)
    assert parent_of(spans["stream"]) == span_id(client)
    assert {span.get_span_context().trace_id for span in spans.values()} == {int(trace_id, 16)}  # type: ignore[union-attr]

    def ms(span: ReadableSpan) -> tuple[float, float]:
        assert span.start_time is not None
        assert span.end_time is not None
        assert root.start_time is not None
        return (span.start_time - root.start_time) / 1e6, (span.end_time - root.start_time) / 1e6

    def near(value: float) -> float:
        # pytest.approx compares equal to the floats it stands for, which its type (ApproxBase) does not say.
        return cast(float, pytest.approx(value, abs=0.01))

    assert ms(root) == (0.0, near(200.0))
    assert ms(spans["parse"]) == (0.0, near(0.1))
    assert ms(spans["auth"]) == (near(0.1), near(0.15))
    assert ms(spans["upstream"]) == (near(0.35), near(50.35))
    assert ms(client) == (near(0.35), near(200.0))
    assert ms(spans["stream"]) == (near(50.5), near(200.0))
    (event,) = spans["stream"].events
    assert event.name == "first_token"
    assert (event.timestamp - root.start_time) / 1e6 == pytest.approx(80.0, abs=0.01)  # type: ignore[operator]
    # Wall-clock placement: the request arrived 200 ms before it was recorded.
    assert abs(root.start_time - (time.time_ns() - 200_000_000)) < 1e9  # type: ignore[operator]

    assert root.attributes is not None
    assert client.attributes is not None
    expected = {
        "http.request.method": "POST",
        "http.route": "/v1/chat/completions",
        "http.response.status_code": 200,
        "sluice.tenant": "acme",
        "sluice.cache": "miss",
        "sluice.request_id": "rid-1",
        "sluice.served_model": "chat-large",
        "sluice.backend": "up",
        "sluice.ttft_ms": 80.0,
        "sluice.tpot_ms": 10.0,
        "sluice.overhead_ms": 0.5,
        "user_agent.original": "OpenAI/Python",
    }
    assert expected.items() <= dict(root.attributes).items()
    assert "error.type" not in root.attributes
    assert "sluice.fallback" not in root.attributes
    assert dict(client.attributes) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "chat-large",
        "gen_ai.response.model": "large",
        "gen_ai.request.stream": True,
        "gen_ai.request.temperature": 0,
        "gen_ai.request.max_tokens": 64,
        "gen_ai.usage.input_tokens": 7,
        "gen_ai.usage.output_tokens": 11,
        "sluice.usage_source": "upstream",
        "gen_ai.response.time_to_first_chunk": pytest.approx((80.0 - 0.35) / 1000.0),
        "server.address": "10.1.2.3",
        "server.port": 8000,
        "sluice.tenant": "acme",
    }
    assert client.status.status_code is StatusCode.UNSET
    assert root.resource.attributes["service.name"] == "sluice-test"


def test_spans_of_a_fallback(traced: tuple[Tracing, InMemorySpanExporter, Fates], upstreams: Upstreams) -> None:
    tracing, memory, _ = traced
    ex = exchange(upstreams, stream=False)
    tracing.begin(ex)
    served(ex, upstreams, "chat-small")
    ex.attempts = [("chat-large", 20.0, 503), ("chat-small", 30.0, 0)]
    ex.fallback = "error"
    outcome = finished()
    outcome.ttft_ms, outcome.tpot_ms = 200.0, None
    tracing.record(ex, outcome)
    tracing.flush()
    spans = by_name(memory.get_finished_spans())
    assert "stream" not in spans  # a whole answer: the body came with the upstream wait
    failed, answered = spans["attempt chat-large"], spans["attempt chat-small"]
    assert parent_of(failed) == parent_of(answered) == span_id(spans["upstream"])
    assert failed.attributes is not None
    assert failed.attributes["error.type"] == "503"
    assert failed.end_time == answered.start_time
    client = spans["chat chat-large"]
    assert client.attributes is not None
    assert client.attributes["gen_ai.response.model"] == "small"
    assert client.attributes["gen_ai.provider.name"] == "openai"
    assert "server.address" not in client.attributes  # the simulated backend has no address
    root = spans["POST /v1/chat/completions"]
    assert root.attributes is not None
    assert root.attributes["sluice.fallback"] == "error"


def test_spans_of_a_cache_hit(traced: tuple[Tracing, InMemorySpanExporter, Fates], upstreams: Upstreams) -> None:
    tracing, memory, _ = traced
    ex = exchange(upstreams)
    tracing.begin(ex)
    ex.timings = [("parse", 0.1), ("auth", 0.05), ("cache", 0.3)]
    ex.overhead_ms = 0.6
    ex.labels["cache"] = "hit"
    outcome = Outcome(status=200, complete=True, total_ms=1.5, source="cache")
    tracing.record(ex, outcome)
    tracing.flush()
    spans = by_name(memory.get_finished_spans())
    assert set(spans) == {"POST /v1/chat/completions", "parse", "auth", "cache", "stream"}
    root = spans["POST /v1/chat/completions"]
    assert parent_of(spans["stream"]) == span_id(root)
    assert root.attributes is not None
    assert root.attributes["sluice.cache"] == "hit"


def test_spans_of_an_upstream_failure(
    traced: tuple[Tracing, InMemorySpanExporter, Fates], upstreams: Upstreams
) -> None:
    tracing, memory, _ = traced
    ex = exchange(upstreams, model="chat-small")
    tracing.begin(ex)
    ex.timings = [("parse", 0.1), ("upstream", 5.0)]
    ex.upstream_ms = 5.0
    ex.overhead_ms = 0.3
    ex.attempts = [("chat-small", 5.0, 503)]
    outcome = Outcome(status=503, error="upstream unavailable", total_ms=6.0, source="error")
    tracing.record(ex, outcome)
    tracing.flush()
    spans = by_name(memory.get_finished_spans())
    assert set(spans) == {"POST /v1/chat/completions", "parse", "chat chat-small", "upstream"}
    root, client = spans["POST /v1/chat/completions"], spans["chat chat-small"]
    assert root.status.status_code is StatusCode.ERROR
    assert client.status.status_code is StatusCode.ERROR
    assert root.attributes is not None
    assert root.attributes["error.type"] == "503"
    assert client.attributes is not None
    assert client.attributes["error.type"] == "503"
    assert "gen_ai.response.model" not in client.attributes


def test_unsampled_requests_build_nothing(settings: Settings, upstreams: Upstreams) -> None:
    memory = InMemorySpanExporter()
    tracing = Tracing(
        settings.model_copy(update={"telemetry": TelemetrySettings(sample_ratio=0.0)}), Fates(), exporter=memory
    )
    try:
        ex = exchange(upstreams)
        tracing.begin(ex)
        assert ex.traceparent is not None
        assert ex.traceparent.endswith(b"-00")  # still propagated upstream
        served(ex, upstreams)
        assert tracing.record(ex, finished()) is None
        tracing.flush()
        assert memory.get_finished_spans() == ()
    finally:
        tracing.shutdown()


@pytest.mark.parametrize("lean", [False, True], ids=["sdk-processor", "lean-queue"])
def test_a_full_queue_drops_whole_traces(
    monkeypatch: pytest.MonkeyPatch, settings: Settings, upstreams: Upstreams, lean: bool
) -> None:
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "10")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")  # nothing leaves the queue during the test
    memory, fates = InMemorySpanExporter(), Fates()
    tracing = lean_tracing(settings, fates) if lean else Tracing(settings, fates, exporter=memory)
    try:
        for _ in range(3):
            ex = exchange(upstreams)
            tracing.begin(ex)
            served(ex, upstreams)
            tracing.record(ex, finished())
        assert fates.counts == {"dropped": 14}  # 7 fit, the next two traces of 7 do not
        if lean:
            assert tracing.queue is not None
            assert len(tracing.queue.queue) == 7
            return
        tracing.flush()
        assert len(memory.get_finished_spans()) == 7
        assert fates.counts == {"dropped": 14, "exported": 7}
    finally:
        tracing.shutdown()


def lean_tracing(settings: Settings, fates: Fates) -> Tracing:
    """Tracing as `sluice serve` has it over OTLP: spans encoded as laid out, queued as bytes. Nothing listens
    at the collector's address, and nothing is sent before the test ends (the queue's delay is a minute)."""
    resource = Resource.create({"service.name": "sluice"})
    scope = InstrumentationScope("sluice", "0")
    exporter = LeanOTLPSpanExporter(resource, scope, f"http://127.0.0.1:{free_port()}/v1/traces")
    tracing = Tracing(settings, fates, exporter=exporter)
    assert tracing.queue is not None
    return tracing


def relative(encoded: list[bytes]) -> list[SpanMessage]:
    """Span messages with their times made relative to the first span's start."""
    spans = [SpanMessage.FromString(data) for data in encoded]
    zero = spans[0].start_time_unix_nano
    for span in spans:
        span.start_time_unix_nano -= zero
        span.end_time_unix_nano -= zero
        for event in span.events:
            event.time_unix_nano -= zero
    return spans


@pytest.mark.parametrize("failed", [False, True])
def test_spans_encoded_as_they_are_laid_out_are_the_sdk_spans_bytes(
    monkeypatch: pytest.MonkeyPatch, settings: Settings, upstreams: Upstreams, failed: bool
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")
    incoming = [(b"traceparent", f"00-{TRACE}-{PARENT}-01".encode()), (b"tracestate", b"vendor=1")]
    ex = exchange(upstreams, json={"temperature": 0, "max_tokens": 64, "seed": 3}, headers=incoming)
    memory, fates = InMemorySpanExporter(), Fates()
    sdk = Tracing(settings, fates, exporter=memory)
    lean = lean_tracing(settings, fates)
    try:
        sdk.begin(ex)
        served(ex, upstreams)
        if failed:
            ex.attempts = [("chat-large", 20.0, 503), ("chat-small", 30.0, 0)]
            outcome = Outcome(status=502, error="upstream broke off", total_ms=200.0)
        else:
            outcome = finished()
        random.seed(11)
        assert sdk.record(ex, outcome) == TRACE
        sdk.flush()
        random.seed(11)  # the same span ids
        assert lean.record(ex, outcome) == TRACE
        assert lean.queue is not None
        assert lean.encoder is not None
        made = memory.get_finished_spans()
        assert len(made) >= 6
        # The same messages but for the wall clock, read once per record: times are compared from the root's start.
        assert relative(list(lean.queue.queue)) == relative([lean.encoder.span(span) for span in made])
    finally:
        sdk.shutdown()
        lean.shutdown()


def test_the_span_queue_sends_full_batches_at_once_and_the_rest_when_closed() -> None:
    sent: list[list[bytes]] = []
    queue = SpanQueue(lambda spans: sent.append(list(spans)), Fates(), capacity=100, batch=4, delay_s=60.0)
    queue.put([b"a"] * 3)  # under a batch: waits for the delay (a minute) or for more
    queue.put([b"b"] * 2)  # a whole batch is waiting: the thread is woken
    deadline = time.monotonic() + 10.0
    while not sent:
        assert time.monotonic() < deadline, "a whole batch was not sent"
        time.sleep(0.01)
    assert sent == [[b"a", b"a", b"a", b"b"]]
    assert queue.close(10.0)
    assert sent == [[b"a", b"a", b"a", b"b"], [b"b"]]


# -- metrics ---------------------------------------------------------------------------------------------------


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, content_type = metrics.exposition("")
    assert content_type.startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def value(found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in found.items() if n == name and labels.items() <= dict(ls).items())


def test_metrics_record_a_request(settings: Settings, upstreams: Upstreams) -> None:
    store = Store("redis://127.0.0.1:1")  # never called: the metrics read its failure count
    metrics = Metrics(settings.telemetry, settings.tenants, {"cache": "none"}, store)
    ex = exchange(upstreams)
    metrics.begin(ex)
    assert value(samples(metrics), "sluice_inflight_requests", stream="true") == 1
    served(ex, upstreams)
    ex.fallback = "slo"
    store.failures = 3
    metrics.record(ex, finished(), 200.0, None)
    found = samples(metrics)
    labels = {"tenant": "acme", "model": "chat-large", "served_model": "chat-large", "backend": "up"}
    assert value(found, "sluice_requests_total", status="200", stream="true", cache="miss", **labels) == 1
    assert value(found, "sluice_request_duration_seconds_sum", **labels) == pytest.approx(0.2)
    assert value(found, "sluice_time_to_first_token_seconds_bucket", le="0.08", **labels) == 1
    assert value(found, "sluice_time_to_first_token_seconds_bucket", le="0.04", **labels) == 0
    assert value(found, "sluice_time_per_output_token_seconds_sum", **labels) == pytest.approx(0.01)
    assert value(found, "sluice_upstream_duration_seconds_sum", **labels) == pytest.approx(0.05)
    assert value(found, "sluice_overhead_seconds_bucket", le="0.0005", **labels) == 1
    assert value(found, "sluice_overhead_seconds_bucket", le="0.00025", **labels) == 0
    assert value(found, "sluice_tokens_total", direction="input", **labels) == 7
    assert value(found, "sluice_tokens_total", direction="output", **labels) == 11
    assert value(found, "sluice_tokens_total", direction="cache_read", **labels) == 0  # the usage named none
    assert value(found, "sluice_fallbacks_total", reason="slo", served_model="chat-large") == 1
    assert value(found, "sluice_redis_failures_total") == 3
    assert value(found, "sluice_inflight_requests") == 0


def test_metrics_count_the_providers_prompt_cache(settings: Settings, upstreams: Upstreams) -> None:
    """usage.prompt_tokens_details.cached_tokens (OpenAI, vLLM) is the `cached` direction: the prompt-cache share."""
    metrics = Metrics(settings.telemetry, settings.tenants, {"cache": "none"})
    ex = exchange(upstreams)
    metrics.begin(ex)
    served(ex, upstreams)
    outcome = finished()
    outcome.usage = {"prompt_tokens": 1000, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 768}}
    metrics.record(ex, outcome, 200.0, None)
    found = samples(metrics)
    assert value(found, "sluice_tokens_total", direction="input", model="chat-large") == 1000
    assert value(found, "sluice_tokens_total", direction="cache_read", model="chat-large") == 768


def test_rate_limit_rejections_and_client_gone(settings: Settings, upstreams: Upstreams) -> None:
    metrics = Metrics(settings.telemetry, settings.tenants)
    rejected = exchange(upstreams)
    rejected.rejected_by = "rate_limit"
    metrics.begin(rejected)
    metrics.record(rejected, Outcome(status=429, error="rate limited", source="error"), 0.3, None)
    upstream_429 = exchange(upstreams)
    metrics.begin(upstream_429)
    upstream_429.attempts = [("chat-large", 3.0, 429), ("chat-small", 2.0, 429)]
    metrics.record(upstream_429, Outcome(status=429, error="busy", source="error"), 5.0, None)
    gone = exchange(upstreams)
    metrics.begin(gone)
    metrics.record(gone, Outcome(status=0, client_gone=True), 40.0, None)
    found = samples(metrics)
    assert value(found, "sluice_plugin_rejections_total", tenant="acme", plugin="rate_limit", status="429") == 1
    assert value(found, "sluice_requests_total", status="429") == 2
    assert value(found, "sluice_requests_total", status="499") == 1
    assert value(found, "sluice_overhead_seconds_count") == 0  # no head was ever sent


def test_tenant_labels_are_bounded() -> None:
    labels = TenantLabels(3, ["zeta", "acme"])
    assert [labels(name) for name in ("acme", "zeta", "new", "newer", "acme", "new")] == [
        "acme", "zeta", "new", "other", "acme", "new",
    ]  # fmt: skip
    assert TenantLabels(1, ["b", "a"])("b") == "other"  # configured tenants are kept in name order


def test_exemplars_carry_the_trace_id_in_openmetrics(settings: Settings, upstreams: Upstreams) -> None:
    metrics = Metrics(settings.telemetry, settings.tenants)
    ex = exchange(upstreams)
    metrics.begin(ex)
    served(ex, upstreams)
    metrics.record(ex, finished(), 200.0, TRACE)
    body, content_type = metrics.exposition("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    exemplars = {
        sample.name: sample.exemplar.labels["trace_id"]
        for family in openmetrics_families(body.decode())
        for sample in family.samples
        if sample.exemplar is not None
    }
    assert exemplars == {
        "sluice_request_duration_seconds_bucket": TRACE,
        "sluice_time_to_first_token_seconds_bucket": TRACE,
        "sluice_time_per_output_token_seconds_bucket": TRACE,
        "sluice_upstream_duration_seconds_bucket": TRACE,
        "sluice_overhead_seconds_bucket": TRACE,
    }
    assert b"trace_id" not in metrics.exposition("text/plain")[0]  # the classic format has no exemplars


def test_server_timing() -> None:
    assert server_timing([("parse", 0.02), ("upstream", 152.3041)], 0.31) == (
        b"parse;dur=0.020, upstream;dur=152.304, overhead;dur=0.310"
    )


@given(st.floats(0.0, 1e8) | st.sampled_from([-2.5, float("nan"), float("inf"), 1e12, 0.9995, 999.9995]))
def test_a_duration_is_written_as_a_float_format_writes_it(ms: float) -> None:
    # The tables round half up on the microsecond where the format rounds the float's exact binary value: they
    # may differ in the last digit only at a tie, which a value drawn at random never is.
    written = ms_text(ms)
    assert ms_value(ms) == written.encode()
    if not 0.0 <= ms < 1e9:
        assert written == f"{ms:.3f}"
        return
    assert len(written.partition(".")[2]) == 3
    assert abs(float(written) - ms) <= 0.0005 + 1e-9
    if abs(ms * 1000.0 % 1.0 - 0.5) > 1e-3:
        assert written == f"{ms:.3f}"


# -- the compose stack: no Docker engine here, so its files are checked for what they promise ----------------

ROOT_DIR = Path(__file__).resolve().parents[4]


def load_yaml(relative: str) -> Any:
    return yaml.safe_load((ROOT_DIR / relative).read_text())


def compose() -> dict[str, Any]:
    services: dict[str, Any] = load_yaml("docker-compose.yml")["services"]
    return services


def test_compose_runs_the_whole_stack() -> None:
    services = compose()
    assert set(services) == {"gateway", "sim", "redis", "jaeger", "prometheus", "grafana", "vllm"}
    assert [name for name, spec in services.items() if spec.get("profiles")] == ["vllm"]
    assert services["vllm"]["profiles"] == ["gpu"]
    for name, spec in services.items():
        for volume in spec.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT_DIR / source).exists(), f"{name}: {source} is mounted but missing"

    gateway = services["gateway"]
    assert gateway["build"] == "."
    assert "8080:8080" in gateway["ports"]
    assert "./config/compose.yaml:/etc/sluice/gateway.yaml:ro" in gateway["volumes"]
    command = gateway["command"]
    assert command[:4] == ["sluice", "serve", "-c", "/etc/sluice/gateway.yaml"]
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert gateway["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"

    sim = services["sim"]["command"]
    assert sim[:2] == ["sluice", "sim"]
    assert sim[sim.index("--host") + 1] == "0.0.0.0"
    assert f"{sim[sim.index('--port') + 1]}:8000" in services["sim"]["ports"]

    jaeger = services["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/jaeger:2.")
    assert {"16686:16686", "4317:4317", "4318:4318"} <= set(jaeger["ports"])
    assert "receivers.otlp.protocols.grpc.endpoint=0.0.0.0:4317" in jaeger["command"]
    assert "receivers.otlp.protocols.http.endpoint=0.0.0.0:4318" in jaeger["command"]

    prometheus = services["prometheus"]
    assert "./config/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    assert "./config/prometheus:/etc/prometheus/prometheus:ro" in prometheus["volumes"]  # its rule_files
    assert "--enable-feature=exemplar-storage" in prometheus["command"]  # exemplars link buckets to traces

    grafana = services["grafana"]
    mounts = dict(volume.rsplit(":", 1)[0].split(":") for volume in grafana["volumes"])
    assert mounts == {
        "./config/grafana/provisioning": "/etc/grafana/provisioning",
        "./config/grafana/dashboards": "/var/lib/grafana/dashboards",
    }
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (ROOT_DIR / "config/grafana/dashboards" / Path(home).relative_to("/var/lib/grafana/dashboards")).exists()

    vllm = services["vllm"]
    assert vllm["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_the_compose_gateway_config_points_at_the_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("REDIS_URL", "OTEL_EXPORTER_OTLP_ENDPOINT", "VLLM_BASE_URL", "VLLM_MODEL", "SLUICE_SAMPLE_RATIO"):
        monkeypatch.delenv(name, raising=False)
    settings = parse((ROOT_DIR / "config/compose.yaml").read_text(), "config/compose.yaml")
    assert (settings.listen.host, settings.listen.port) == ("0.0.0.0", 8080)
    assert settings.telemetry.otlp_endpoint == "http://jaeger:4318"
    assert settings.telemetry.sample_ratio == 1.0
    assert settings.redis.url == "redis://redis:6379/0"
    sim = compose()["sim"]["command"]
    port = sim[sim.index("--port") + 1]
    urls = {backend.base_url for backend in settings.backends.values() if hasattr(backend, "base_url")}
    assert urls == {f"http://sim:{port}/v1"}  # the vLLM backend stands in with the simulator unless told
    assert {"auth", "cache", "slo"} <= set(settings.plugins)

    scrape = load_yaml("config/prometheus.yml")["scrape_configs"]
    (job,) = [job for job in scrape if job["job_name"] == "sluice"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"gateway:{settings.admin.port}"]  # the admin listener
    assert f"{settings.admin.port}:{settings.admin.port}" not in compose()["gateway"]["ports"]  # not on the host


def test_the_dockerfile_serves_the_mounted_config() -> None:
    lines = (ROOT_DIR / "Dockerfile").read_text().splitlines()
    assert "FROM python:3.11-slim" in lines
    assert any(line.startswith("RUN pip install .") for line in lines)
    for line in lines:
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT_DIR / source).exists(), source
    (cmd,) = [line for line in lines if line.startswith("CMD ")]
    assert json.loads(cmd[4:]) == ["sluice", "serve", "-c", "/etc/sluice/gateway.yaml", "--host", "0.0.0.0"]


def test_grafana_is_provisioned_with_the_dashboard(monkeypatch: pytest.MonkeyPatch) -> None:
    datasources = load_yaml("config/grafana/provisioning/datasources/datasources.yaml")["datasources"]
    uids = {source["type"]: source["uid"] for source in datasources}
    assert set(uids) == {"prometheus", "jaeger"}
    (prometheus,) = [source for source in datasources if source["type"] == "prometheus"]
    assert prometheus["url"] == "http://prometheus:9090"
    assert prometheus["jsonData"]["exemplarTraceIdDestinations"] == [{"name": "trace_id", "datasourceUid": "jaeger"}]
    providers = load_yaml("config/grafana/provisioning/dashboards/dashboards.yaml")["providers"]
    assert providers[0]["options"]["path"] == "/var/lib/grafana/dashboards"

    dashboard = json.loads((ROOT_DIR / "config/grafana/dashboards/sluice.json").read_text())
    # Every series a panel asks for is one the gateway exports, with labels it has.
    # The series the gateway and its plugins export with the compose stack's config, the plugins' own included.
    for name in ("REDIS_URL", "OTEL_EXPORTER_OTLP_ENDPOINT", "VLLM_BASE_URL", "VLLM_MODEL", "SLUICE_SAMPLE_RATIO"):
        monkeypatch.delenv(name, raising=False)
    built = Runtime(parse((ROOT_DIR / "config/compose.yaml").read_text(), "config/compose.yaml"))
    # Built-in plugins the stack does not list (the semantic cache needs an embedding model) have panels too:
    # their series, from a default build with no models.
    listed = {plugin.name for plugin in built.plugins}
    others = []
    for name in BUILTIN:
        cls = load_class(name)
        if cls.name not in listed:
            schema = schema_of(cls)
            others.append(cls(Configured(schema.section(), {}, {}), built.settings))
    for plugin in [*built.plugins, *others]:
        if plugin.name != "auth":  # its start-up subscribes to Redis; it makes no series
            stub = cast("Runtime", SimpleNamespace(store=None, meter=built.meter, upstreams=built.upstreams))
            asyncio.run(plugin.startup(stub))  # type: ignore[attr-defined]
    registry: Any = built.telemetry.metrics.registry
    exported = {
        name: {*getattr(collector, "_labelnames", ()), "le"}
        for name, collector in registry._names_to_collectors.items()
    }
    titles = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        titles.append(panel["title"])
        assert panel["datasource"]["uid"] == uids["prometheus"]
        for target in panel["targets"]:
            expr = target["expr"]
            names = re.findall(r"\bsluice_[a-z_]+", expr)
            assert names, expr
            for name in names:
                assert name in exported, f"{panel['title']}: {name} is not exported"
            for clause in re.findall(r"by \(([^)]*)\)", expr):
                for label in (part.strip() for part in clause.split(",")):
                    assert any(label in exported[name] for name in names), f"{panel['title']}: no label {label}"
    assert {"TTFT p95 by tenant", "Gateway overhead p50 / p95 / p99", "Cache hit ratio by model", "SLO state"} <= set(
        titles
    )
    assert {variable["name"] for variable in dashboard["templating"]["list"]} == {"tenant", "model"}


def test_a_routed_request_has_a_route_span_naming_the_endpoint(
    traced: tuple[Tracing, InMemorySpanExporter, Fates], upstreams: Upstreams
) -> None:
    tracing, memory, _ = traced
    ex = exchange(upstreams)
    tracing.begin(ex)
    served(ex, upstreams)
    ex.timings.insert(3, ("route", 0.01))
    ex.routed = ("10.0.0.7:8000", "prefix", 0.75)
    tracing.record(ex, finished())
    tracing.flush()
    spans = by_name(memory.get_finished_spans())
    route = spans["route"]
    assert route.attributes is not None
    assert dict(route.attributes) == {
        "sluice.endpoint": "10.0.0.7:8000",
        "sluice.route.policy": "prefix",
        "sluice.route.score": 0.75,
    }
    client = spans["chat chat-large"].attributes
    assert client is not None
    assert (client["server.address"], client["server.port"]) == ("10.0.0.7", 8000)


@given(st.lists(st.tuples(st.sampled_from(["parse", "cache", "upstream"]), st.floats(-1.0, 5000.0)), max_size=8))
@example([("parse", -0.001), ("cache", -0.0004), ("upstream", 0.0005)])  # int() rounds toward zero: once 0.000
def test_server_timing_gives_each_stage_to_the_microsecond(timings: list[tuple[str, float]]) -> None:
    header = server_timing(timings, 0.3105).decode()
    entries = [entry.split(";dur=") for entry in header.split(", ")]
    assert [name for name, _ in entries] == [name for name, _ in timings] + ["overhead"]
    for (_, text), ms in zip(entries, [ms for _, ms in timings] + [0.3105], strict=True):
        assert len(text.partition(".")[2]) == 3
        assert abs(float(text) - ms) <= 0.0005 + 1e-9
