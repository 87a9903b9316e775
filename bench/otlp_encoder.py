"""CPU per span: the OpenTelemetry SDK's OTLP encoder against the gateway's lean one (gateway/telemetry/otlp.py).

    python3 -m bench.otlp_encoder                  # 64 traces shaped like the gateway's, 20 rounds each
    python3 -m bench.otlp_encoder --traces 256 --rounds 50

The spans are those of one proxied request with every stage on (a root with the gateway's attributes, a span
per stage, the inference span and its upstream and pool spans: nine). CPU per span is `time.process_time()`
over the rounds divided by the spans encoded; both encoders make the same request bytes, which is checked.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from gateway.telemetry.otlp import Encoder
from gateway.telemetry.tracing import HashedResource

SAMPLED = TraceFlags(TraceFlags.SAMPLED)
UNSET = Status(StatusCode.UNSET)
RESOURCE = HashedResource(
    Resource.create({"service.name": "sluice", "service.version": "0.1.0", "service.instance.id": "f" * 32})
)
SCOPE = InstrumentationScope("sluice", "0.1.0")
ROOT = {
    "http.request.method": "POST", "http.route": "/v1/chat/completions", "url.path": "/v1/chat/completions",
    "url.scheme": "http", "network.protocol.version": "1.1", "server.address": "127.0.0.1", "server.port": 8080,
    "sluice.request_id": "0" * 32, "sluice.tenant": "bench", "sluice.model": "fast", "sluice.source": "upstream",
    "sluice.overhead_ms": 0.123, "http.response.status_code": 200, "user_agent.original": "OpenAI/Python 2.8.1",
    "sluice.served_model": "fast", "sluice.backend": "fast", "sluice.cache": "miss", "sluice.slo": "ok",
    "sluice.ttft_ms": 1.234,
}  # fmt: skip
INFERENCE = {
    "gen_ai.operation.name": "chat", "gen_ai.request.model": "fast", "gen_ai.request.stream": False,
    "sluice.tenant": "bench", "gen_ai.provider.name": "openai", "server.address": "127.0.0.1", "server.port": 9000,
    "gen_ai.response.model": "fast", "gen_ai.usage.input_tokens": 12, "gen_ai.usage.output_tokens": 5,
    "sluice.usage_source": "upstream",
}  # fmt: skip


def one(name: str, trace_id: int, parent: SpanContext | None, attributes: dict[str, object], kind: SpanKind,
        at: int) -> ReadableSpan:  # fmt: skip
    context = SpanContext(trace_id, random.getrandbits(64) or 1, False, SAMPLED)
    return ReadableSpan(
        name,
        context,
        parent,
        RESOURCE,
        attributes,  # type: ignore[arg-type]
        (),
        (),
        kind,
        None,
        UNSET,
        at,
        at + 100_000,
        SCOPE,
    )


def trace() -> list[ReadableSpan]:
    trace_id, at = random.getrandbits(128) or 1, time.time_ns()
    root = one("POST /v1/chat/completions", trace_id, None, ROOT, SpanKind.SERVER, at)
    spans = [root]
    spans += [one(stage, trace_id, root.context, {}, SpanKind.INTERNAL, at) for stage in
              ("parse", "auth", "rate_limit", "cache", "slo")]  # fmt: skip
    inference = one("chat fast", trace_id, root.context, INFERENCE, SpanKind.CLIENT, at)
    upstream = one("upstream", trace_id, inference.context, {"sluice.attempts": 1}, SpanKind.INTERNAL, at)
    pool = one("pool", trace_id, upstream.context, {}, SpanKind.INTERNAL, at)
    return [*spans, inference, upstream, pool]


def cpu_per_span(encode: Callable[[list[ReadableSpan]], bytes], spans: list[ReadableSpan], rounds: int) -> float:
    encode(spans)  # warm-up
    started = time.process_time()
    for _ in range(rounds):
        encode(spans)
    return (time.process_time() - started) / rounds / len(spans) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20)
    options = parser.parse_args()
    spans = [span for _ in range(options.traces) for span in trace()]
    encoder = Encoder(RESOURCE, SCOPE)

    def sdk(batch: list[ReadableSpan]) -> bytes:
        data: bytes = encode_spans(batch).SerializePartialToString()
        return data

    def lean(batch: list[ReadableSpan]) -> bytes:
        return encoder.request([encoder.span(span) for span in batch])

    same = ExportTraceServiceRequest.FromString(lean(spans)) == encode_spans(spans)
    print(f"{len(spans)} spans per batch, {options.rounds} rounds; the same request bytes: {same}")
    for name, encode in (("SDK encoder", sdk), ("lean encoder", lean)):
        print(f"{name:>12}: {cpu_per_span(encode, spans, options.rounds):.1f} us CPU per span")


if __name__ == "__main__":
    main()
