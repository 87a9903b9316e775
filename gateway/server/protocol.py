"""The HTTP/1.1 server protocol: uvicorn's httptools protocol, with limits on what a client sends before its body.

Like nginx's `large_client_header_buffers`, `client_header_timeout` and `client_body_timeout`:
- the request head (request line and headers) is capped at `limits.max_header_bytes`: over it, 431;
- a head must arrive within `limits.header_timeout_s` of its first byte (or of the connection opening): 408;
- a body may not pause for longer than `limits.body_timeout_s`: 408.
- at the file-descriptor limit (two sockets a stream: its client's and its upstream's), a request on a connection
  accepted past what the limit allows gets a 503 with `retry-after` instead of a reset at accept.
Requests the parser rejects (a bad content-length, a NUL in a header, an unknown method) get a 400. Every one
of these answers is in OpenAI's error format, with `connection: close`.

What a connection reads goes to its Reader (reader.py: the limits, the timers, the parser's events, the direct
path), which the compiled build makes native; this class keeps what is uvicorn's: the ASGI path, the upgrade,
the refusals.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from uvicorn.config import Config
from uvicorn.logging import TRACE_LOG_LEVEL
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import (
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.protocols.utils import get_local_addr, get_remote_addr, is_ssl
from uvicorn.server import ServerState

from gateway import errors
from gateway.server.address import Address
from gateway.server.direct import Direct, body_bytes, head_bytes
from gateway.server.loop import running_loop
from gateway.server.reader import Reader
from gateway.server.reply import BODY_FOLLOWS
from gateway.server.request import ARRIVED, new_request_id
from gateway.settings import LimitSettings
from gateway.upstream import descriptors

log = logging.getLogger("sluice.http")

REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}
# Descriptors kept for what is not a client's stream: the listener, the loop, logs, Redis, warm upstreams,
# and the connections accepted past the cap, each held only until its 503 is written.
RESERVED_FDS = 128
RETRY_AFTER_S = 1


class Cycle(RequestResponseCycle):
    """uvicorn's request cycle, writing a response head marked BODY_FOLLOWS together with the body's first part.

    A whole answer goes out in one write instead of two, and a stream's head with its first chunk. Each header
    name is checked once per process and the values in one C pass, where uvicorn runs two regex searches per
    header (about 0.2 µs each here). Anything else (an unmarked head, HEAD, a name not lower-case, or
    `connection` or `transfer-encoding` set by the app) is uvicorn's own path.
    """

    head: bytes | None = None  # the head held for the first body part

    async def send(self, message: Any) -> None:
        kind = message["type"]
        if self.head is not None and kind == "http.response.body":
            await self._send_first(message)
            return
        if kind == "http.response.start" and message.get(BODY_FOLLOWS) and not self.response_started:
            self.response_started = True  # as uvicorn does before it checks the headers: a bad one ends the connection
            head = self._head(message)
            if head is not None:
                self.head = head
                self.waiting_for_100_continue = False
                return
            self.response_started = False
        await super().send(message)

    def _head(self, message: Any) -> bytes | None:
        if self.access_log or self.disconnected or self.scope["method"] == "HEAD":
            return None
        pairs = [*self.default_headers, *message.get("headers", ())]
        framed = head_bytes(message["status"], pairs, self.keep_alive, self.chunked_encoding)
        if framed is None:
            return None  # uvicorn's path: it lower-cases, refuses a bad name, or honours the header
        head, length, self.chunked_encoding = framed
        if length is not None:
            self.expected_content_length = length
        return head

    async def _send_first(self, message: Any) -> None:
        head, self.head = self.head, None
        assert head is not None
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if self.chunked_encoding:
            out = head + body_bytes(body, more)
        else:
            if len(body) > self.expected_content_length:
                raise RuntimeError("Response content longer than Content-Length")
            self.expected_content_length -= len(body)
            out = head + body
        self.transport.write(out)
        if not more:
            if self.expected_content_length != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                self.transport.close()
            self.on_response()


@functools.cache
def connection_cap() -> int:
    """Client connections the soft descriptor limit carries, each with an upstream socket; read once, after
    `sluice serve` raised the limit (the protocol is made only once the server runs)."""
    return max((descriptors.soft_limit() - RESERVED_FDS) // 2, 1)


class GatewayProtocol(HttpToolsProtocol):
    """uvicorn's protocol for what goes through ASGI; the bytes read and the parser's events go to its Reader."""

    warned = False  # the descriptor limit was reached and logged: once per process

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        # uvicorn passes no loop and would ask for it, a system call per connection (server/loop.py).
        super().__init__(config, server_state, app_state, _loop or running_loop())
        limits: LimitSettings = getattr(getattr(self.app, "settings", None), "limits", None) or LimitSettings()
        self.arrived = 0.0  # perf_counter() when the current request's first byte was read (the ASGI scope's)
        # Where the app serves a proxy route without ASGI: the handler for a path, or None for the ASGI app.
        # Not with what only the ASGI cycle does: uvicorn's access log, a root path, a concurrency limit.
        route = getattr(self.app, "direct_route", None)
        plain_server = not self.access_log and not self.root_path and self.limit_concurrency is None
        self.reader = reader = Reader(self, limits, route if plain_server else None)
        reader.cap = connection_cap
        self.parser = reader.parser  # the parser calls the reader; uvicorn's own code asks it about the request
        # The transport calls the reader's bound method, found on the protocol when the transport is made.
        self.data_received = reader.data_received  # type: ignore[method-assign]

    server = Address(get_local_addr)  # looked up when read (server/address.py), as uvicorn's connection_made does
    client = Address(get_remote_addr)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # uvicorn's, but for the addresses, looked up when first read (server/address.py).
        self.connections.add(self)
        self.transport = transport
        self.flow = FlowControl(transport)
        self.scheme = "https" if is_ssl(transport) else "http"
        if self.logger.level <= TRACE_LOG_LEVEL:
            client = self.client
            self.logger.log(TRACE_LOG_LEVEL, "%sHTTP connection made", f"{client[0]}:{client[1]} - " if client else "")
        if len(self.server_state.connections) > connection_cap():
            self.reader.over_cap = True
            if not GatewayProtocol.warned:
                GatewayProtocol.warned = True
                log.warning(
                    "file descriptors: %d client connections open, the most a soft limit of %d carries (two "
                    "sockets a stream); requests on connections past it get 503 with retry-after "
                    "(logged once; raise the limit: systemd LimitNOFILE, ulimit -n, the container's nofile)",
                    connection_cap(),
                    descriptors.soft_limit(),
                )
        self.reader.connection_made(transport, self.flow)

    def connection_lost(self, exc: Exception | None) -> None:
        self.reader.connection_lost()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.reader.data_received(data)  # where a transport looks the method up on the class

    def on_response_complete(self) -> None:
        self.reader.response_complete()  # an ASGI cycle's end (a Direct calls the reader's own)

    def _unset_keepalive_if_required(self) -> None:
        self.reader.idle_since = None  # uvicorn's connection_lost: the reader's keep-alive timer finds it

    # What the reader hands over: a request for the ASGI app, its body, its end; an upgrade; a refusal.
    def asgi_head(
        self, url: bytes, headers: list[tuple[bytes, bytes]], expect_100_continue: bool, arrived: float
    ) -> None:
        self.url = url
        self.headers = headers
        self.expect_100_continue = expect_100_continue
        self.arrived = arrived
        self.scope = self._scope()
        super().on_headers_complete()

    def asgi_body(self, body: bytes) -> None:
        super().on_body(body)

    def asgi_complete(self) -> None:
        super().on_message_complete()

    def upgrade(self) -> None:
        if self._should_upgrade():
            self.handle_websocket_upgrade()
        else:
            self._unsupported_upgrade_warning()

    def start_asgi(self, cycle: Any, app: Any) -> None:
        self._start_asgi_task(cycle, app)

    def _scope(self) -> Any:
        """The ASGI scope uvicorn makes for a request (in its on_message_begin), with the first byte's time."""
        return {
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
            ARRIVED: self.arrived,
        }

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        if type(cycle) is Direct:  # a pipelined request on a proxy route, its turn come
            self.reader.start_direct(cycle, app)
            return
        cycle.__class__ = Cycle  # made by uvicorn's on_headers_complete; it has not run yet
        super()._start_asgi_task(cycle, app)

    def send_400_response(self, msg: str) -> None:
        self.reject(400, msg, "invalid_http_request")

    def reject(self, status: int, message: str, code: str, retry_after: bool = False) -> None:
        """The request refused with `status`, in OpenAI's error format, and the connection closed."""
        log.debug("rejected a request from %s: %s", self.client, message)
        self.reader.disarm()
        kind = "server_error" if status >= 500 else "invalid_request_error"
        body = errors.GatewayError(message, status=status, type=kind, code=code).body()
        head = b"HTTP/1.1 %d %s\r\n" % (status, REASONS[status])
        head += b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n" % len(body)
        if retry_after:
            head += b"retry-after: %d\r\n" % RETRY_AFTER_S
        head += b"x-request-id: " + new_request_id().encode() + b"\r\n\r\n"
        self.transport.write(head + body)
        self.transport.close()
