"""The probe's HTTP/1.1 client: one request at a time, with every connection phase timed.

A general-purpose client hides when DNS, TCP, TLS and the first byte happen, so the probe opens its own
sockets: getaddrinfo, a non-blocking connect, the TLS handshake as a step of its own, the request written by
hand and the answer parsed with httptools as it arrives, each read stamped with perf_counter. Server-sent events
are split and decoded here to find the first token and the gaps between tokens. All times are milliseconds since
the request started, as `curl -w` reports them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httptools

from gateway.upstream.pool import Origin
from gateway.wire.marks import FIRST_TOKEN

USER_AGENT = "sluice-probe"
# Azure OpenAI takes its key in `api-key`; every other OpenAI-compatible server in `Authorization`.
AZURE_HOST_SUFFIXES = (".openai.azure.com", ".cognitiveservices.azure.com", ".services.ai.azure.com")
READ_SIZE = 65536
MAX_BODY = 1 << 20  # kept of a non-streamed or error body: enough for any completion or error message
OVERHEAD_HEADER = "x-sluice-overhead-ms"


class ProbeError(Exception):
    """The endpoint answered, but not as an OpenAI-compatible endpoint should."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where one side of the probe sends its requests: a base URL such as `https://host/v1` and its key."""

    scheme: str
    host: str
    port: int
    path: str  # the base path without a trailing slash
    query: str  # kept on every request (Azure's api-version)
    key: str | None

    @classmethod
    def parse(cls, url: str, key: str | None) -> Endpoint:
        origin = Origin.from_url(url)
        parts = urlsplit(url)
        return cls(origin.scheme, origin.host, origin.port, parts.path.rstrip("/"), parts.query, key)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self._authority()}{self.path}"

    def request(self, method: str, suffix: str, body: bytes | None, stream: bool) -> bytes:
        """The whole HTTP/1.1 request for `base path + suffix`."""
        target = self.path + suffix + (f"?{self.query}" if self.query else "")
        lines = [
            f"{method} {target} HTTP/1.1",
            f"host: {self._authority()}",
            f"user-agent: {USER_AGENT}",
            f"accept: {'text/event-stream' if stream else 'application/json'}",
        ]
        if self.key:
            azure = self.host.endswith(AZURE_HOST_SUFFIXES)
            lines.append(f"api-key: {self.key}" if azure else f"authorization: Bearer {self.key}")
        if body is not None:
            lines += ["content-type: application/json", f"content-length: {len(body)}"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")

    def _authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


@dataclass(slots=True)
class Sample:
    """One request as the probe saw it. Phase times are ms since the request started; None = did not happen."""

    target: str  # "direct" or "via"
    probe: str  # minimal | medium | long
    stream: bool
    connection: str  # "fresh" (opened for this request) or "reused" (kept alive from an earlier one)
    role: str  # "cold" (the very first request) | "warmup" | "sample"
    status: int | None = None
    dns_ms: float | None = None
    connect_ms: float | None = None
    tls_ms: float | None = None
    sent_ms: float | None = None
    ttfb_ms: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    total_ms: float | None = None
    tokens: int = 0
    gaps_ms: list[float] = field(default_factory=list)  # between consecutive content events
    server_timing: dict[str, float] = field(default_factory=dict)
    overhead_ms: float | None = None  # x-sluice-overhead-ms, when the server is Sluice
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.__slots__:
            value = getattr(self, name)
            if isinstance(value, float):
                value = round(value, 3)
            elif name == "gaps_ms":
                value = [round(gap, 3) for gap in value]
            out[name] = value
        return out


class _Answer:
    """httptools callbacks for one response; `now` is the time of the read being parsed."""

    def __init__(self, stream: bool, now: float) -> None:
        self.stream = stream
        self.now = now
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.completed_at = now
        self.sent_at: float | None = None
        self.first_at: float | None = None
        self.body = bytearray()
        self.pending = b""  # SSE bytes after the last complete event
        self.token_times: list[float] = []
        self.done = False  # `data: [DONE]` seen
        self.error: str | None = None

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.head_done = True
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.stream and 200 <= self.status < 300:
            self._events(body)
        elif len(self.body) < MAX_BODY:
            self.body += body

    def on_message_complete(self) -> None:
        self.complete = True
        self.completed_at = self.now
        # Read here: once the callback returns, the parser has reset its flags for the next message.
        self.keep_alive = self.parser.should_keep_alive()

    def _events(self, data: bytes) -> None:
        # Events end with a blank line; either line ending is allowed by the SSE spec.
        buffer = (self.pending + data).replace(b"\r\n", b"\n")
        *events, self.pending = buffer.split(b"\n\n")
        for event in events:
            lines = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
            if lines:
                self._event(b"\n".join(lines))

    def _event(self, data: bytes) -> None:
        if data == b"[DONE]":
            self.done = True
            return
        try:
            payload = json.loads(data)
        except ValueError:
            self.error = self.error or f"an event is not JSON: {data[:120]!r}"
            return
        if not isinstance(payload, dict):
            self.error = self.error or f"an event is not a JSON object: {data[:120]!r}"
        elif "error" in payload:
            self.error = self.error or f"error event in the stream: {_message(payload)}"
        elif FIRST_TOKEN.search(data):  # what the gateway counts as a token: text, a tool call, reasoning
            self.token_times.append(self.now)


def _message(payload: dict[str, Any]) -> str:
    error = payload.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def server_timing(value: str) -> dict[str, float]:
    """`upstream;dur=152.3, overhead;dur=0.3` -> {"upstream": 152.3, ...}; entries without a duration are left out."""
    out: dict[str, float] = {}
    for entry in value.split(","):
        name, *params = (part.strip() for part in entry.split(";"))
        for param in params:
            key, _, number = param.partition("=")
            if key.strip().lower() == "dur" and name:
                with contextlib.suppress(ValueError):
                    out[name] = float(number.strip().strip('"'))
    return out


def tls_context() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.set_alpn_protocols(["http/1.1"])  # the client speaks HTTP/1.1 only
    return context


def _since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


class Connection:
    """One open connection; requests on it run one at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, endpoint: Endpoint, context: ssl.SSLContext, sample: Sample, start: float) -> Connection:
        """Resolve, connect and (for https) shake hands, recording each phase on `sample`."""
        # Blocking on purpose: requests run one at a time, and a thread hop would add to the DNS figure.
        addresses = socket.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM)
        sample.dns_ms = _since(start)
        sock = await _connect(addresses)
        try:
            if endpoint.scheme == "https":
                sample.connect_ms = _since(start)
                reader, writer = await asyncio.open_connection(
                    sock=sock, ssl=context, server_hostname=endpoint.host, limit=READ_SIZE
                )
                sample.tls_ms = _since(start)
            else:
                reader, writer = await asyncio.open_connection(sock=sock, limit=READ_SIZE)
                sample.connect_ms = _since(start)
        except BaseException:
            sock.close()
            raise
        return cls(reader, writer)

    async def exchange(self, request: bytes, sample: Sample, start: float) -> bool:
        """Send one request and read its answer whole, filling `sample`; whether the connection may be reused."""
        answer = _Answer(sample.stream, start)
        try:
            await self._round_trip(request, answer)
        finally:
            # Kept even when the answer fails half-way: when it stopped says where it failed.
            sample.status = answer.status or None
            if answer.sent_at is not None:
                sample.sent_ms = (answer.sent_at - start) * 1000.0
            if answer.first_at is not None:
                sample.ttfb_ms = (answer.first_at - start) * 1000.0
        _fill(sample, answer, start)
        return answer.keep_alive

    async def fetch(self, request: bytes) -> tuple[int, bytes]:
        """Status and body of a request whose timing does not matter (the model list)."""
        answer = _Answer(False, time.perf_counter())
        await self._round_trip(request, answer)
        return answer.status, bytes(answer.body)

    async def _round_trip(self, request: bytes, answer: _Answer) -> None:
        self.writer.write(request)
        await self.writer.drain()
        answer.sent_at = time.perf_counter()
        while not answer.complete:
            data = await self.reader.read(READ_SIZE)
            answer.now = time.perf_counter()
            if not data:
                _end_of_body(answer)
                return
            if answer.first_at is None:
                answer.first_at = answer.now
            answer.parser.feed_data(data)

    async def close(self) -> None:
        self.writer.close()
        # A TLS peer may never answer close_notify: do not wait for it for long.
        with contextlib.suppress(OSError, TimeoutError, ssl.SSLError):
            await asyncio.wait_for(self.writer.wait_closed(), 1.0)


async def _connect(addresses: list[Any]) -> socket.socket:
    loop = asyncio.get_running_loop()
    failure: OSError = OSError("the host name resolved to no address")
    for family, kind, proto, _, address in addresses:
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, address)
        except OSError as exc:
            sock.close()
            failure = exc
            continue
        except BaseException:
            sock.close()
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    raise failure


def _end_of_body(answer: _Answer) -> None:
    """The peer closed: fine only for a body delimited by the close itself."""
    framed = "content-length" in answer.headers or "chunked" in answer.headers.get("transfer-encoding", "")
    if not answer.head_done or framed:
        raise ProbeError("the connection closed before the answer was complete")
    answer.complete = True
    answer.completed_at = answer.now


def _fill(sample: Sample, answer: _Answer, start: float) -> None:
    sample.total_ms = (answer.completed_at - start) * 1000.0
    if OVERHEAD_HEADER in answer.headers:
        with contextlib.suppress(ValueError):
            sample.overhead_ms = float(answer.headers[OVERHEAD_HEADER])
    if "server-timing" in answer.headers:
        sample.server_timing = server_timing(answer.headers["server-timing"])
    if not 200 <= answer.status < 300:
        text = bytes(answer.body[:300]).decode("utf-8", "replace").strip()
        raise ProbeError(f"HTTP {answer.status}: {text}" if text else f"HTTP {answer.status}")
    if sample.stream:
        _fill_stream(sample, answer, start)
    else:
        sample.tokens = _completion_tokens(bytes(answer.body))


def _fill_stream(sample: Sample, answer: _Answer, start: float) -> None:
    if "text/event-stream" not in answer.headers.get("content-type", ""):
        raise ProbeError(f"a stream was asked for, the answer is {answer.headers.get('content-type', 'untyped')}")
    times = answer.token_times
    sample.tokens = len(times)
    if times:
        sample.ttft_ms = (times[0] - start) * 1000.0
        sample.gaps_ms = [(later - earlier) * 1000.0 for earlier, later in itertools.pairwise(times)]
    if sample.gaps_ms:
        sample.tpot_ms = sum(sample.gaps_ms) / len(sample.gaps_ms)
    if answer.error is not None:
        raise ProbeError(answer.error)
    if not answer.done:
        raise ProbeError("the stream ended without data: [DONE]")


def _completion_tokens(body: bytes) -> int:
    try:
        payload = json.loads(body)
    except ValueError:
        raise ProbeError(f"the answer is not JSON: {body[:120]!r}") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("choices"), list):
        raise ProbeError("the answer has no choices")
    usage = payload.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])
    return 0


def model_ids(body: bytes) -> list[str]:
    """The ids of a `GET /models` answer."""
    try:
        payload = json.loads(body)
    except ValueError:
        return []
    data = payload.get("data") if isinstance(payload, dict) else None
    return [item["id"] for item in data or () if isinstance(item, dict) and isinstance(item.get("id"), str)]
