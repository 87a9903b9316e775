"""A standalone simulated upstream: an OpenAI- and Azure-shaped HTTP/1.1 server with scripted timing.

It is the "direct" baseline of the benchmarks and the upstream of the integration tests and the demo, so it
is kept as cheap as the gateway's own pool: a raw asyncio protocol, httptools parsing, keep-alive, and timers
instead of tasks (a streamed answer is one `call_at` chain writing one HTTP chunk per SSE event).

Routes: `POST /v1/{chat/completions,completions,embeddings,responses}` (also under `/openai/v1/`), the Azure shape
`POST /openai/deployments/{deployment}/...` (the deployment is the model reported), `GET /v1/models`,
`GET /health` and `GET /healthz`. The headers `x-sim-ttft-ms`, `x-sim-tpot-ms` and `x-sim-tokens` override
the profile for one request; every response carries `x-sim-requests`, the number of model calls (chat,
completions, embeddings) this server has received so far.

Replicas with batching, a queue and a prefix cache, and stand-ins for vLLM, TGI, llama.cpp and Ollama
(`sluice sim --replicas/--like`), are `tools.sim.fleet`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ssl
import time
from collections import deque
from typing import Any, cast
from urllib.parse import unquote

import httptools
import orjson

from gateway.simulation.answers import Profile, Reply, error_reply, json_reply, simulate

_ENDPOINTS = {
    b"chat/completions": "chat/completions",
    b"completions": "completions",
    b"embeddings": "embeddings",
    b"responses": "responses",
}
_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed"}
_MODELS = {"object": "list", "data": [{"id": "sim", "object": "model", "created": 0, "owned_by": "sluice"}]}
_OVERRIDES = (b"x-sim-ttft-ms", b"x-sim-tpot-ms", b"x-sim-tokens")
_MAX_TOKENS = 100_000


class State:
    """What the connections of one server share: the profile and the count of model calls.

    Setting `profile` on a running server changes how every connection answers its next request. With `stamp`,
    a stream's first token is preceded by an SSE comment, `: sent SECONDS`, the time it was written on the host's
    monotonic clock (`time.perf_counter`): a client on the same host can tell what lay between the upstream and
    itself (a gateway, say) from what was the upstream's own delay. Clients skip SSE comments.
    """

    __slots__ = ("profile", "requests", "stamp")

    def __init__(self, profile: Profile, stamp: bool = False) -> None:
        self.profile = profile
        self.requests = 0
        self.stamp = stamp


class _Request:
    __slots__ = ("body", "keep_alive", "method", "overrides", "reply", "url")

    def __init__(
        self,
        method: bytes,
        url: bytes,
        overrides: dict[bytes, bytes],
        body: bytes,
        keep_alive: bool,
        reply: Reply | None = None,  # already known: the answer to a request that could not be parsed
    ) -> None:
        self.method = method
        self.url = url
        self.overrides = overrides
        self.body = body
        self.keep_alive = keep_alive
        self.reply = reply


class _Connection(asyncio.Protocol):
    """One client connection. Requests are answered one at a time, in order; pipelined ones wait their turn."""

    def __init__(self, server: State) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[_Request] = deque()
        self.url = b""
        self.overrides: dict[bytes, bytes] = {}
        self.body: list[bytes] = []
        self.closing = False  # no more requests are read on this connection
        # The answer being written: its script, the next piece, when it started, its pending timer.
        self.reply: Reply | None = None
        self.keep_alive = True
        self.count = 0  # x-sim-requests for this answer
        self.index = 0
        self.start = 0.0
        self.timer: asyncio.TimerHandle | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A cast, not an isinstance check: uvloop's transports do not subclass asyncio.Transport.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return  # after a request that closes the connection, or a malformed one, nothing more is read
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse("protocol upgrades are not supported")
        except httptools.HttpParserError:
            if not self.closing:
                self._refuse("malformed HTTP request")

    def pause_writing(self) -> None:
        # A client that does not read its answers does not get to send more requests either.
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        # The client left, maybe mid-stream: drop the rest of the script and anything queued.
        self._close()

    # httptools callbacks

    def on_message_begin(self) -> None:
        self.url = b""
        self.overrides = {}
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in _OVERRIDES:
            self.overrides[name] = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        keep_alive = self.parser.should_keep_alive()
        self.queue.append(_Request(method, self.url, self.overrides, b"".join(self.body), keep_alive))
        self.closing = not keep_alive
        if self.reply is None:
            self._next()

    # Writing answers

    def _refuse(self, message: str) -> None:
        """Answer what came before, then this 400, then close."""
        self.closing = True
        self.queue.append(_Request(b"", b"", {}, b"", False, error_reply(400, message)))
        if self.reply is None:
            self._next()

    def _next(self) -> None:
        """Answer queued requests in order until one has to wait for a timer."""
        while self.queue and self.reply is None and self.transport is not None:
            request = self.queue.popleft()
            reply = request.reply or _answer(self.server, request)
            self._begin(reply, request.keep_alive, self.server.requests)

    def _begin(self, reply: Reply, keep_alive: bool, count: int) -> None:
        assert self.transport is not None
        self.reply = reply
        self.keep_alive = keep_alive
        self.count = count
        self.index = 0
        self.start = self.loop.time()
        self._play([_head(reply, count, keep_alive, None)] if reply.stream else [])

    def _play(self, out: list[bytes]) -> None:
        """Write `out` and every piece already due in one go, then wait for the next piece or finish."""
        reply = self.reply
        transport = self.transport
        assert reply is not None
        assert transport is not None
        pieces = reply.pieces
        now = self.loop.time()
        while self.index < len(pieces) and self._due_at(self.index) <= now:
            out.append(self._frame(self._piece(self.index)))
            self.index += 1
        done = self.index == len(pieces)
        if done and reply.stream:
            out.append(b"0\r\n\r\n")
        if out:
            transport.write(b"".join(out))
        if not done:
            self.timer = self.loop.call_at(self._due_at(self.index), self._on_timer)
            return
        self.reply = None
        if not self.keep_alive:
            self._close()

    def _on_timer(self) -> None:
        self.timer = None
        reply = self.reply
        if reply is not None:
            # The piece the timer was set for is due, even if the loop's clock reads a hair earlier.
            piece = self._piece(self.index)
            self.index += 1
            self._play([self._frame(piece)])
            if self.reply is None:
                self._next()

    def _piece(self, index: int) -> bytes:
        assert self.reply is not None
        piece = self.reply.pieces[index]
        if index == 0 and self.server.stamp and self.reply.stream:
            return b": sent %.6f\n\n%b" % (time.perf_counter(), piece)
        return piece

    def _due_at(self, index: int) -> float:
        assert self.reply is not None
        return self.start + self.reply.ttft_s + index * self.reply.tpot_s

    def _frame(self, piece: bytes) -> bytes:
        assert self.reply is not None
        if self.reply.stream:
            return b"%x\r\n%b\r\n" % (len(piece), piece)
        return _head(self.reply, self.count, self.keep_alive, len(piece)) + piece

    def _close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.reply = None
        self.queue.clear()
        if self.transport is not None:
            transport = self.transport
            self.transport = None
            transport.close()


def _head(reply: Reply, requests: int, keep_alive: bool, length: int | None) -> bytes:
    reason = _REASONS.get(reply.status, b"Unknown")
    lines = [b"HTTP/1.1 %d %b\r\ncontent-type: %b\r\n" % (reply.status, reason, reply.content_type)]
    if length is None:
        lines.append(b"transfer-encoding: chunked\r\ncache-control: no-cache\r\n")
    else:
        lines.append(b"content-length: %d\r\n" % length)
    if not keep_alive:
        lines.append(b"connection: close\r\n")
    lines.append(b"x-sim-requests: %d\r\n\r\n" % requests)
    return b"".join(lines)


def _answer(server: State, request: _Request) -> Reply:
    """Route one request and script its answer."""
    path = request.url.partition(b"?")[0]
    if path in (b"/health", b"/healthz"):
        return json_reply(200, {"status": "ok"})
    if path in (b"/v1/models", b"/openai/v1/models"):
        return json_reply(200, _MODELS) if request.method == b"GET" else _not_allowed()
    found = _route(path)
    if found is None:
        return error_reply(404, f"unknown path {path.decode('latin-1')}")
    if request.method != b"POST":
        return _not_allowed()
    server.requests += 1
    endpoint, deployment = found
    try:
        body = orjson.loads(request.body)
    except orjson.JSONDecodeError:
        return error_reply(400, "the request body is not valid JSON")
    if not isinstance(body, dict):
        return error_reply(400, "the request body must be a JSON object")
    model = deployment or body.get("model")
    if not isinstance(model, str) or not model:
        return error_reply(400, "you must provide a model parameter", "model")
    try:
        profile = _profile(server.profile, request.overrides)
    except ValueError as exc:
        return error_reply(400, str(exc))
    return simulate(endpoint, body, model, profile)


def _route(path: bytes) -> tuple[str, str | None] | None:
    """(endpoint, Azure deployment or None) for a model-call path, None for any other path."""
    for prefix in (b"/v1/", b"/openai/v1/"):
        if path.startswith(prefix):
            endpoint = _ENDPOINTS.get(path[len(prefix) :])
            return None if endpoint is None else (endpoint, None)
    if path.startswith(b"/openai/deployments/"):
        deployment, _, rest = path[len(b"/openai/deployments/") :].partition(b"/")
        endpoint = _ENDPOINTS.get(rest)
        if deployment and endpoint is not None:
            return endpoint, unquote(deployment.decode("latin-1"))
    return None


def _profile(base: Profile, overrides: dict[bytes, bytes]) -> Profile:
    if not overrides:
        return base
    changes: dict[str, Any] = {}
    for header, field in ((b"x-sim-ttft-ms", "ttft_ms"), (b"x-sim-tpot-ms", "tpot_ms")):
        if header in overrides:
            changes[field] = _number(header, overrides[header], 600_000)
    if b"x-sim-tokens" in overrides:
        tokens = _number(b"x-sim-tokens", overrides[b"x-sim-tokens"], _MAX_TOKENS)
        if not tokens.is_integer() or tokens < 1:
            raise ValueError("x-sim-tokens must be a positive integer")
        changes["tokens"] = int(tokens)
    return dataclasses.replace(base, **changes)


def _number(header: bytes, raw: bytes, high: float) -> float:
    try:
        value = float(raw.decode("latin-1"))
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= high:
        raise ValueError(f"{header.decode()} must be a number from 0 to {high:g}")
    return value


def _not_allowed() -> Reply:
    return error_reply(405, "method not allowed")


async def start_server(
    host: str, port: int, profile: Profile, state: State | None = None, tls: ssl.SSLContext | None = None
) -> asyncio.Server:
    """Listen on host:port (0 picks a free port) on the running loop and return the started server.

    Pass a `state` to change the profile while it runs, a server-side `tls` context to serve HTTPS.
    """
    loop = asyncio.get_running_loop()
    shared = state if state is not None else State(profile)
    return await loop.create_server(lambda: _Connection(shared), host, port, backlog=2048, ssl=tls)


async def _serve(host: str, port: int, profile: Profile, stamp: bool) -> None:
    server = await start_server(host, port, profile, State(profile, stamp))
    bound = server.sockets[0].getsockname()[1]
    print(
        f"sluice sim listening on http://{host}:{bound}/v1 "
        f"(ttft {profile.ttft_ms:g} ms, tpot {profile.tpot_ms:g} ms, {profile.tokens} tokens)",
        flush=True,
    )
    async with server:
        await server.serve_forever()


def main(host: str, port: int, profile: Profile, stamp: bool = False) -> None:
    """Serve until interrupted, on uvloop where it is installed."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - platforms without uvloop
        run: Any = asyncio.run
    else:
        run = uvloop.run
    with contextlib.suppress(KeyboardInterrupt):
        run(_serve(host, port, profile, stamp))
