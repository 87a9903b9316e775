"""An OTLP/HTTP trace sink for `sluice bench`: answers 200 to `POST /v1/traces` and counts what it got.

It stands in for a collector so that the `tracing` scenario measures what exporting costs the gateway, not
what a real collector costs the machine. Each export is decoded to count its spans (a collector would decode
it too); `GET /stats` returns `{"requests", "spans", "bytes"}` as JSON. Run: `python -m
tools.bench.sink --port N`.
"""

from __future__ import annotations

import argparse
import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

OK_BODY = ExportTraceServiceResponse().SerializeToString()


class Tally:
    """What the sink received; the exporter and the stats reader use different connections (threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0
        self.spans = 0
        self.bytes = 0

    def add(self, body: bytes) -> None:
        message = ExportTraceServiceRequest()
        message.ParseFromString(body)
        spans = sum(len(scope.spans) for resource in message.resource_spans for scope in resource.scope_spans)
        with self.lock:
            self.requests += 1
            self.spans += spans
            self.bytes += len(body)

    def json(self) -> bytes:
        with self.lock:
            return orjson.dumps({"requests": self.requests, "spans": self.spans, "bytes": self.bytes})


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the exporter reuses one connection
    server: Sink

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path.rstrip("/") != "/v1/traces":
            self.reply(404, b"", "text/plain")
            return
        if self.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        self.server.tally.add(body)
        self.reply(200, OK_BODY, "application/x-protobuf")

    def do_GET(self) -> None:
        if self.path == "/stats":
            self.reply(200, self.server.tally.json(), "application/json")
        else:
            self.reply(404, b"", "text/plain")

    def reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Silent: a line per export would cost the load generator's CPU."""


class Sink(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.tally = Tally()


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench_sink", description="OTLP/HTTP trace sink that counts spans.")
    parser.add_argument("--port", type=int, required=True)
    with Sink(parser.parse_args().port) as sink:
        sink.serve_forever()


if __name__ == "__main__":
    main()
