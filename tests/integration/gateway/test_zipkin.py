"""Zipkin export end to end: the real gateway, a scripted upstream, and a real receiver of Zipkin's v2 JSON API.

The same request through a gateway that exports over OTLP (to the OTLP receiver of test_telemetry) and one
that exports to Zipkin must give the same trace: the same spans, names, parents and kinds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.config import parse
from gateway.settings import ConfigError
from tests.integration.gateway.test_telemetry import (
    CLIENT_SPAN,
    CLIENT_TRACE,
    KEY,
    MESSAGES,
    ROOT,
    OtlpReceiver,
    Span,
    metric,
    scrape,
)
from tests.integration.gateway.test_telemetry import config as otlp_config
from tests.support.gateway import RunningGateway, free_port, gateway_thread
from tests.support.upstream import Ok, ScriptedUpstream
from tests.support.zipkin import ZipkinReceiver, ZipkinSpan

ZIPKIN_TELEMETRY = 'telemetry: {{exporter: zipkin, zipkin_endpoint: "{url}", service_name: sluice-it}}'


def zipkin_config(upstream: str, zipkin: str) -> str:
    text = otlp_config(upstream, "http://127.0.0.1:9")
    otlp_line = 'telemetry: {otlp_endpoint: "http://127.0.0.1:9", service_name: sluice-it}'
    assert otlp_line in text
    return text.replace(otlp_line, ZIPKIN_TELEMETRY.format(url=zipkin))


@pytest.fixture()
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream(default=Ok(ttft_ms=30, tpot_ms=3, tokens=6)) as up:
        yield up


@pytest.fixture()
def zipkin() -> Iterator[ZipkinReceiver]:
    receiver = ZipkinReceiver()
    yield receiver
    receiver.close()


def stream(gw: RunningGateway, **headers: str) -> httpx.Response:
    body = {"model": "chat", "messages": MESSAGES, "temperature": 0, "stream": True}
    body |= {"stream_options": {"include_usage": True}}
    response = httpx.post(
        f"{gw.base_url}/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {KEY}", "cache-control": "no-cache", **headers},
        timeout=10,
    )
    assert response.status_code == 200
    return response


OTLP_KINDS = {1: None, 2: "SERVER", 3: "CLIENT"}  # OTLP's SpanKind numbers; Zipkin leaves INTERNAL out


def otlp_shape(spans: dict[str, Span]) -> set[tuple[str, str | None, str | None]]:
    """Each span as (name, its parent's name, kind): what both exports must agree on."""
    names = {span.span_id: name for name, span in spans.items()}
    return {(name, names.get(span.parent), OTLP_KINDS[span.kind]) for name, span in spans.items()}


def zipkin_shape(spans: dict[str, ZipkinSpan]) -> set[tuple[str, str | None, str | None]]:
    names = {span["id"]: name for name, span in spans.items()}
    return {(name, names.get(span.get("parentId", "")), span.get("kind")) for name, span in spans.items()}


def test_a_request_is_one_zipkin_trace_with_the_otlp_spans(
    fast_export: None, upstream: ScriptedUpstream, zipkin: ZipkinReceiver
) -> None:
    otlp = OtlpReceiver()
    try:
        with gateway_thread(otlp_config(upstream.url, otlp.url)) as gw:
            stream(gw)
            otlp_trace = upstream.requests[-1].headers["traceparent"].split("-")[1]
            otlp_spans = otlp.trace(otlp_trace, 8)
    finally:
        otlp.close()
    with gateway_thread(zipkin_config(upstream.url, zipkin.url)) as gw:
        stream(gw)
        _, trace_id, parent_id, flags = upstream.requests[-1].headers["traceparent"].split("-")
        spans = zipkin.trace(trace_id, 8)
    assert {span["traceId"] for span in zipkin.spans} == {trace_id}  # one request, one trace

    assert zipkin_shape(spans) == otlp_shape(otlp_spans)
    assert set(spans) == {ROOT, "parse", "auth", "cache", "chat chat", "upstream", "pool", "stream"}

    root, client_span = spans[ROOT], spans["chat chat"]
    assert "parentId" not in root
    assert root["kind"] == "SERVER"
    assert flags == "01"
    assert client_span["id"] == parent_id  # the upstream continues the trace under the inference span
    assert root["localEndpoint"]["serviceName"] == "sluice-it"
    for span in spans.values():  # microseconds, every span inside the root
        assert root["timestamp"] <= span["timestamp"]
        assert span["timestamp"] + span["duration"] <= root["timestamp"] + root["duration"] + 1
    assert spans["upstream"]["duration"] >= 30_000
    assert root["tags"]["sluice.tenant"] == "acme"
    assert root["tags"]["http.response.status_code"] == "200"
    assert client_span["tags"]["gen_ai.request.model"] == "chat"
    assert client_span["tags"]["gen_ai.usage.output_tokens"] == "6"
    ((annotation),) = spans["stream"]["annotations"]
    # The exporter writes an event as a JSON annotation: {name: attributes}.
    ((event, attributes),) = json.loads(annotation["value"]).items()
    assert event == "first_token"
    assert attributes["sluice.ttft_ms"] >= 30.0
    assert spans["stream"]["timestamp"] <= annotation["timestamp"] <= root["timestamp"] + root["duration"]


def test_an_incoming_traceparent_is_continued_in_zipkin(
    fast_export: None, upstream: ScriptedUpstream, zipkin: ZipkinReceiver
) -> None:
    with gateway_thread(zipkin_config(upstream.url, zipkin.url)) as gw:
        stream(gw, traceparent=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
        spans = zipkin.trace(CLIENT_TRACE, 8)
    assert spans[ROOT]["parentId"] == CLIENT_SPAN


def test_a_zipkin_that_is_down_costs_requests_nothing(fast_export: None, upstream: ScriptedUpstream) -> None:
    closed = f"http://127.0.0.1:{free_port()}/api/v2/spans"  # nothing listens there
    with gateway_thread(zipkin_config(upstream.url, closed)) as gw:
        for _ in range(10):
            stream(gw)
        failed = 0.0
        deadline = time.monotonic() + 10
        while not failed and time.monotonic() < deadline:
            time.sleep(0.1)
            failed = metric(scrape(gw), "sluice_trace_spans_total", result="export_failed")
        assert failed > 0  # the export failed, and was counted
        assert stream(gw).status_code == 200
        stopping = time.perf_counter()
    assert time.perf_counter() - stopping < 5.0  # shutdown does not wait on the collector


def test_zipkin_needs_an_endpoint(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^<config>: telemetry\.zipkin_endpoint: the zipkin exporter needs"):
        parse("backends: {s: {type: simulated}}\nmodels: {m: {backend: s}}\ntelemetry: {exporter: zipkin}\n")
    path = tmp_path / "bad.yaml"
    path.write_text(
        "backends: {s: {type: simulated}}\nmodels: {m: {backend: s}}\n" + ZIPKIN_TELEMETRY.format(url="zipkin:9411")
    )
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "check", "-c", str(path)], capture_output=True, text=True
    )
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        f"sluice: config error: {path}: telemetry.zipkin_endpoint: the zipkin exporter needs an http(s) URL such as "
        "http://zipkin:9411/api/v2/spans, got 'zipkin:9411'"
    ]
    with pytest.raises(ConfigError, match=r"telemetry\.exporter: Input should be 'otlp' or 'zipkin'"):
        parse("backends: {s: {type: simulated}}\nmodels: {m: {backend: s}}\ntelemetry: {exporter: jaeger}\n")


@pytest.mark.parametrize(("exporter", "imported"), [("otlp", False), ("zipkin", True)])
def test_the_zipkin_exporter_is_imported_only_when_chosen(exporter: str, imported: bool, tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(
        "backends: {s: {type: simulated}}\nmodels: {m: {backend: s}}\n"
        f"telemetry: {{exporter: {exporter}, otlp_endpoint: http://127.0.0.1:9, zipkin_endpoint: http://127.0.0.1:9}}\n"
    )
    program = (
        "import sys\n"
        "from gateway.config import load\n"
        "from gateway.telemetry.tracing import Tracing\n"
        "tracing = Tracing(load(sys.argv[1]), lambda result, n: None)\n"
        "print(type(tracing.exporter.inner).__name__, 'opentelemetry.exporter.zipkin.json' in sys.modules)\n"
        "tracing.shutdown()\n"
    )
    done = subprocess.run([sys.executable, "-c", program, str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    expected = "ZipkinExporter" if imported else "LeanOTLPSpanExporter"
    assert done.stdout.split() == [expected, str(imported)]
