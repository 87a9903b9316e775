"""Traces and metrics end to end: the real gateway, a scripted upstream, a real OTLP/HTTP receiver, /metrics.

The receiver is a small HTTP server on 127.0.0.1 that decodes what the gateway's exporter POSTs to
/v1/traces with the OTLP protobuf schema, as a collector would.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from plugins.auth.keys import new_key
from tests.support.collector import SpanCollector
from tests.support.gateway import RunningGateway, free_port, gateway_process, gateway_thread
from tests.support.upstream import Ok, ScriptedUpstream, Status
from tests.support.wait import wait_until

KEY, KEY_HASH = new_key()
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is a sluice?"}]
ROOT = "POST /v1/chat/completions"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SPAN_KIND_SERVER, SPAN_KIND_CLIENT = 2, 3
STATUS_ERROR = 2


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent: str
    kind: int
    start: int
    end: int
    status: int
    attributes: dict[str, Any]
    events: list[tuple[str, int]]
    resource: dict[str, Any]

    def within(self, other: Span) -> bool:
        return other.start <= self.start <= self.end <= other.end

    @property
    def ms(self) -> float:
        return (self.end - self.start) / 1e6


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs if isinstance(pair, KeyValue)}


class OtlpReceiver(SpanCollector[Span]):
    """POST /v1/traces (protobuf, gzip or not) on 127.0.0.1; every span decoded and kept."""

    def __init__(self) -> None:
        super().__init__(lambda span: span.trace_id, lambda span: span.name)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = self.path == "/v1/traces" and self.headers.get("content-type") == "application/x-protobuf"
                if ok:
                    receiver.take_request(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 400)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def take_request(self, request: ExportTraceServiceRequest) -> None:
        got = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    got.append(
                        Span(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent=span.parent_span_id.hex(),
                            kind=span.kind,
                            start=span.start_time_unix_nano,
                            end=span.end_time_unix_nano,
                            status=span.status.code,
                            attributes=_attributes(span.attributes),
                            events=[(event.name, event.time_unix_nano) for event in span.events],
                            resource=resource,
                        )
                    )
        self.take(got)

    def request(self, request_id: str, count: int) -> dict[str, Span]:
        """The spans of the trace whose root carries this x-request-id."""
        roots = self.wait(lambda spans: any(span.attributes.get("sluice.request_id") == request_id for span in spans))
        (root,) = [span for span in roots if span.attributes.get("sluice.request_id") == request_id]
        return self.trace(root.trace_id, count)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def config(upstream: str, otlp: str, extra: str = "") -> str:
    return f"""
backends:
  up: {{type: openai, base_url: "{upstream}/v1", api_key: backend-key}}
pool: {{warm_connections: 1}}
models:
  chat: {{backend: up, upstream_model: real-model, fallback: [backup]}}
  backup: {{backend: up, upstream_model: backup-model}}
  solo: {{backend: up, upstream_model: solo-model}}
tenants:
  acme: {{keys: ["{KEY_HASH}"]}}
telemetry: {{otlp_endpoint: "{otlp}", service_name: sluice-it}}
plugins: [auth, cache]
{extra}
"""


@pytest.fixture()
def receiver() -> Iterator[OtlpReceiver]:
    otlp = OtlpReceiver()
    yield otlp
    otlp.close()


@pytest.fixture()
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream(default=Ok(ttft_ms=30, tpot_ms=3, tokens=6)) as up:
        yield up


@pytest.fixture()
def gateway(fast_export: None, upstream: ScriptedUpstream, receiver: OtlpReceiver) -> Iterator[RunningGateway]:
    with gateway_thread(config(upstream.url, receiver.url)) as gw:
        yield gw


def chat(gw: RunningGateway, model: str = "chat", stream: bool = True, **headers: str) -> httpx.Response:
    body: dict[str, Any] = {"model": model, "messages": MESSAGES, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return httpx.post(
        f"{gw.base_url}/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {KEY}", **{k.replace("_", "-"): v for k, v in headers.items()}},
        timeout=10,
    )


def children(spans: dict[str, Span], parent: Span) -> set[str]:
    return {name for name, span in spans.items() if span.parent == parent.span_id}


def test_a_cache_miss_is_one_trace_continued_by_the_upstream(
    gateway: RunningGateway, upstream: ScriptedUpstream, receiver: OtlpReceiver
) -> None:
    started = time.perf_counter()
    client = openai.OpenAI(base_url=gateway.base_url, api_key=KEY, max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="chat", messages=MESSAGES, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    elapsed_ms = (time.perf_counter() - started) * 1000.0
    assert chunks[-1].usage is not None
    (sent,) = [r.headers["traceparent"] for r in upstream.requests if r.path.endswith("/chat/completions")]
    version, trace_id, parent_id, flags = sent.split("-")
    assert (version, flags) == ("00", "01")

    spans = receiver.trace(trace_id, 8)
    assert {span.trace_id for span in receiver.spans} == {trace_id}  # one request, one trace
    root, client_span = spans[ROOT], spans["chat chat"]
    assert root.parent == ""
    assert root.kind == SPAN_KIND_SERVER
    assert children(spans, root) == {"parse", "auth", "cache", "chat chat"}
    assert children(spans, client_span) == {"upstream", "stream"}
    assert children(spans, spans["upstream"]) == {"pool"}
    assert spans["upstream"].start == spans["pool"].start
    assert spans["pool"].end <= spans["upstream"].end
    assert client_span.kind == SPAN_KIND_CLIENT
    assert client_span.span_id == parent_id  # the upstream's parent

    # The timings add up: every span inside the root, stages in order, the root no longer than the client saw.
    assert all(span.within(root) for span in spans.values())
    assert spans["parse"].end <= spans["auth"].start <= spans["auth"].end <= spans["cache"].start
    assert spans["cache"].end <= spans["upstream"].start
    assert spans["upstream"].end <= spans["stream"].start
    assert sum(spans[name].ms for name in ("parse", "auth", "cache", "upstream")) <= root.ms
    assert spans["upstream"].ms >= 30.0
    assert client_span.end == root.end
    assert root.ms <= elapsed_ms
    ((event, at),) = spans["stream"].events
    assert event == "first_token"
    assert spans["stream"].start <= at <= spans["stream"].end

    assert {key: root.attributes.get(key) for key in ("http.route", "http.response.status_code", "sluice.tenant")} == {
        "http.route": "/v1/chat/completions",
        "http.response.status_code": 200,
        "sluice.tenant": "acme",
    }
    assert root.attributes["sluice.cache"] == "miss"
    assert root.attributes["sluice.ttft_ms"] >= 30.0
    assert root.attributes["sluice.overhead_ms"] > 0
    assert "sluice.fallback" not in root.attributes
    genai = {key: value for key, value in client_span.attributes.items() if key.startswith(("gen_ai.", "server."))}
    assert genai == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "chat",
        "gen_ai.response.model": "real-model",
        "gen_ai.request.stream": True,
        "gen_ai.request.temperature": 0,
        "gen_ai.usage.input_tokens": 4,
        "gen_ai.usage.output_tokens": 6,
        "gen_ai.response.time_to_first_chunk": pytest.approx(genai["gen_ai.response.time_to_first_chunk"]),
        "server.address": "127.0.0.1",
        "server.port": upstream.port,
    }
    assert genai["gen_ai.response.time_to_first_chunk"] >= 0.03
    assert root.resource["service.name"] == "sluice-it"


def test_a_cache_hit_has_no_upstream_spans(
    gateway: RunningGateway, upstream: ScriptedUpstream, receiver: OtlpReceiver
) -> None:
    assert chat(gateway, stream=False, x_request_id="fill-1").headers["x-sluice-cache"] == "miss"
    gateway.settle()  # the entry is written after the response ends
    assert chat(gateway, stream=True, x_request_id="hit-1").headers["x-sluice-cache"] == "hit"
    spans = receiver.request("hit-1", 5)
    assert set(spans) == {ROOT, "parse", "auth", "cache", "stream"}
    assert children(spans, spans[ROOT]) == {"parse", "auth", "cache", "stream"}
    assert spans[ROOT].attributes["sluice.cache"] == "hit"
    filled = receiver.request("fill-1", 7)  # a whole answer: its body came with the upstream wait, no stream
    assert set(filled) == {ROOT, "parse", "auth", "cache", "chat chat", "upstream", "pool"}
    assert sum(r.path.endswith("/chat/completions") for r in upstream.requests) == 1


def test_an_upstream_failure_and_a_fallback(
    gateway: RunningGateway, upstream: ScriptedUpstream, receiver: OtlpReceiver
) -> None:
    upstream.script(Status(503))
    assert chat(gateway, model="solo", x_request_id="fail-1").status_code == 503
    spans = receiver.request("fail-1", 6)
    assert set(spans) == {ROOT, "parse", "auth", "cache", "chat solo", "upstream"}
    root, client_span = spans[ROOT], spans["chat solo"]
    assert root.status == STATUS_ERROR
    assert root.attributes["error.type"] == "503"
    assert client_span.status == STATUS_ERROR
    assert client_span.attributes["error.type"] == "503"
    assert "gen_ai.response.model" not in client_span.attributes

    upstream.script(Status(503))
    assert chat(gateway, model="chat", stream=True, x_request_id="fallback-1").status_code == 200
    spans = receiver.request("fallback-1", 10)
    assert spans[ROOT].attributes["sluice.fallback"] == "error"
    assert children(spans, spans["upstream"]) == {"attempt chat", "attempt backup", "pool"}
    assert spans["attempt chat"].attributes["error.type"] == "503"
    assert spans["attempt chat"].end <= spans["attempt backup"].start
    assert spans["chat chat"].attributes["gen_ai.response.model"] == "backup-model"
    assert spans["chat chat"].status != STATUS_ERROR


def test_an_incoming_traceparent_is_continued(
    gateway: RunningGateway, upstream: ScriptedUpstream, receiver: OtlpReceiver
) -> None:
    response = chat(gateway, traceparent=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
    assert response.status_code == 200
    _, trace_id, parent_id, flags = upstream.requests[-1].headers["traceparent"].split("-")
    assert (trace_id, flags) == (CLIENT_TRACE, "01")
    spans = receiver.trace(CLIENT_TRACE, 8)
    assert spans[ROOT].parent == CLIENT_SPAN
    assert spans["chat chat"].span_id == parent_id

    # A client that did not sample: the decision is followed, the context still goes upstream.
    unsampled = "0af7651916cd43dd8448eb211c80319c"
    chat(gateway, stream=False, traceparent=f"00-{unsampled}-{CLIENT_SPAN}-00", cache_control="no-cache")
    _, trace_id, _, flags = upstream.requests[-1].headers["traceparent"].split("-")
    assert (trace_id, flags) == (unsampled, "00")
    time.sleep(0.3)  # not a wait for a condition: export rounds in which nothing may come
    assert not [span for span in receiver.spans if span.trace_id == unsampled]


def test_a_collector_that_is_down_costs_requests_nothing(
    fast_export: None, monkeypatch: pytest.MonkeyPatch, upstream: ScriptedUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    upstream.default = Ok(tokens=3)
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with gateway_thread(config(upstream.url, closed)) as gw:
        slowest = 0.0
        for i in range(30):
            started = time.perf_counter()
            response = chat(gw, stream=i % 2 == 0, cache_control="no-cache")
            slowest = max(slowest, time.perf_counter() - started)
            assert response.status_code == 200
        # Not a speed check: a request that waited on the dead collector would take its 1 s export timeout or more.
        assert slowest < 2.0, slowest
        # The exporter gives up, and says so.
        wait_until(lambda: metric(scrape(gw), "sluice_trace_spans_total", result="export_failed") > 0, interval=0.2)
        first = metric(scrape(gw), "sluice_trace_spans_total", result="export_failed")
        assert chat(gw, stream=False, cache_control="no-cache").status_code == 200
        wait_until(
            lambda: metric(scrape(gw), "sluice_trace_spans_total", result="export_failed") > first,
            interval=0.2,
            what="a later export failing too",
        )
        failing = [r for r in caplog.records if r.getMessage().startswith("trace collector failing")]
        assert len(failing) == 1  # once, not once per batch
        assert failing[0].name == "sluice.tracing"
        stopping = time.perf_counter()
    assert time.perf_counter() - stopping < 5.0  # shutdown does not wait on the collector


# -- /metrics --------------------------------------------------------------------------------------------------


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(gw: RunningGateway) -> Samples:
    response = httpx.get(f"{gw.url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def metric(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


def test_metrics_after_a_known_workload(
    gateway: RunningGateway, upstream: ScriptedUpstream, receiver: OtlpReceiver
) -> None:
    assert chat(gateway, stream=False).headers["x-sluice-cache"] == "miss"
    gateway.settle()
    assert chat(gateway, stream=False).headers["x-sluice-cache"] == "hit"
    for _ in range(2):
        response = httpx.post(
            f"{gateway.base_url}/chat/completions",
            json={"model": "chat", "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}},
            headers={"authorization": f"Bearer {KEY}"},
        )
        assert response.headers["x-sluice-cache"] == "bypass"
    assert chat(gateway, authorization="Bearer wrong").status_code == 401
    gateway.settle()  # the completion tasks run after the responses

    found = scrape(gateway)
    acme = {"tenant": "acme", "model": "chat"}
    assert metric(found, "sluice_requests_total", status="200", **acme) == 4
    assert metric(found, "sluice_requests_total", status="200", cache="hit", served_model="", **acme) == 1
    assert metric(found, "sluice_requests_total", status="401", tenant="anonymous", cache="none") == 1
    assert metric(found, "sluice_request_duration_seconds_count") == 5
    assert metric(found, "sluice_overhead_seconds_count") == 5
    assert metric(found, "sluice_upstream_duration_seconds_count", **acme) == 3
    assert metric(found, "sluice_time_to_first_token_seconds_count", **acme) == 4  # not the 401
    assert metric(found, "sluice_time_to_first_token_seconds_bucket", le="0.02", cache="bypass") == 0
    assert metric(found, "sluice_time_to_first_token_seconds_bucket", le="+Inf", cache="bypass") == 2
    assert metric(found, "sluice_time_per_output_token_seconds_count", stream="true") == 2
    assert metric(found, "sluice_tokens_total", direction="input", **acme) == 3 * 4
    assert metric(found, "sluice_tokens_total", direction="output", **acme) == 3 * 6
    assert metric(found, "sluice_cache_results_total", result="miss") == 1
    assert metric(found, "sluice_cache_results_total", result="hit") == 1
    assert metric(found, "sluice_cache_results_total", result="bypass") == 2
    assert metric(found, "sluice_inflight_requests") == 0
    assert metric(found, "sluice_fallbacks_total") == 0

    # OpenMetrics, for scrapers that ask: exemplars link the latency buckets to the traces.
    response = httpx.get(f"{gateway.url}/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    exemplars = {
        sample.exemplar.labels["trace_id"]
        for family in openmetrics_families(response.text)
        for sample in family.samples
        if sample.exemplar is not None and family.name == "sluice_request_duration_seconds"
    }
    assert len(exemplars) >= 2  # each bucket keeps the last exemplar that fell in it
    receiver.wait(lambda spans: exemplars <= {span.trace_id for span in spans})  # each one a trace in the collector


def test_metrics_add_up_across_two_workers(tmp_path: Path) -> None:
    sim = "backends: {s: {type: simulated, ttft_ms: 30, tpot_ms: 1, tokens: 4}}\nmodels: {m: {backend: s}}\n"
    body = {"model": "m", "messages": MESSAGES}
    # The CLI makes the multiprocess directory under TMPDIR: here, where the test can look into it.
    with gateway_process(sim, tmp_path, "--workers", "2", env={"TMPDIR": str(tmp_path)}) as gw:
        (directory,) = tmp_path.glob("sluice-metrics-*")

        def one(_: int) -> int:
            return httpx.post(f"{gw.base_url}/chat/completions", json=body, timeout=10).status_code

        def per_worker() -> list[float]:
            return [
                sum(value for key, value, *_ in MmapedDict.read_all_values_from_file(str(path)) if "requests" in key)
                for path in directory.glob("counter_*.db")
            ]

        sent = 0
        with ThreadPoolExecutor(8) as pool:
            while sent < 400 and (sent < 40 or min(per_worker(), default=0) == 0):
                assert set(pool.map(one, range(40))) == {200}  # a fresh connection each: both workers get some
                sent += 40
                time.sleep(0.1)  # not a wait for a condition: a pause between batches
        assert len(per_worker()) == 2
        assert min(per_worker()) > 0  # both workers served and recorded
        for _ in range(6):  # whichever worker answers the scrape, it reports both
            found = scrape(gw)
            assert metric(found, "sluice_requests_total", status="200", model="m") == sent
            assert metric(found, "sluice_request_duration_seconds_count") == sent
            assert metric(found, "sluice_tokens_total", direction="output") == 4 * sent
            assert metric(found, "sluice_inflight_requests") == 0
    assert not list(tmp_path.glob("sluice-metrics-*"))  # removed when the gateway stopped
