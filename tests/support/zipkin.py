"""A Zipkin collector's v2 API on 127.0.0.1: POST /api/v2/spans with a JSON list of spans, every span kept.

As Zipkin does, it answers 202 to a well-formed list and 400 to anything else, so an exporter that sends the
wrong path, content type or shape fails its export.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ZipkinSpan = dict[str, Any]
REQUIRED = ("traceId", "id", "name", "timestamp", "duration", "localEndpoint")


class ZipkinReceiver:
    def __init__(self) -> None:
        self.spans: list[ZipkinSpan] = []
        self.posts = 0
        self.cond = threading.Condition()
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

    def take(self, spans: list[ZipkinSpan]) -> None:
        with self.cond:
            self.spans.extend(spans)
            self.posts += 1
            self.cond.notify_all()

    def wait(self, predicate: Callable[[list[ZipkinSpan]], bool], timeout: float = 10.0) -> list[ZipkinSpan]:
        with self.cond:
            assert self.cond.wait_for(lambda: predicate(self.spans), timeout), f"spans so far: {self.spans}"
            return list(self.spans)

    def trace(self, trace_id: str, count: int) -> dict[str, ZipkinSpan]:
        """The spans of one trace, by name, once `count` have arrived; fails if more arrive just after."""
        self.wait(lambda spans: sum(span["traceId"] == trace_id for span in spans) >= count)
        time.sleep(0.2)  # several export rounds: anything more of this trace would have come by now
        spans = [span for span in self.spans if span["traceId"] == trace_id]
        named = {span["name"]: span for span in spans}
        assert len(spans) == count == len(named), [span["name"] for span in spans]
        return named

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
