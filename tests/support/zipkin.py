"""A Zipkin collector's v2 API on 127.0.0.1: POST /api/v2/spans with a JSON list of spans, every span kept.

As Zipkin does, it answers 202 to a well-formed list and 400 to anything else, so an exporter that sends the
wrong path, content type or shape fails its export.
"""

from __future__ import annotations

import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.support.collector import SpanCollector

ZipkinSpan = dict[str, Any]
REQUIRED = ("traceId", "id", "name", "timestamp", "duration", "localEndpoint")


class ZipkinReceiver(SpanCollector[ZipkinSpan]):
    def __init__(self) -> None:
        super().__init__(lambda span: str(span["traceId"]), lambda span: str(span["name"]))
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                spans = None
                if self.path == "/api/v2/spans" and self.headers.get("content-type") == "application/json":
                    try:
                        spans = json.loads(body)
                    except ValueError:
                        spans = None
                ok = isinstance(spans, list) and all(
                    isinstance(span, dict) and all(key in span for key in REQUIRED) for span in spans
                )
                if ok:
                    receiver.take(spans)  # type: ignore[arg-type]
                self.send_response(202 if ok else 400)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api/v2/spans"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
