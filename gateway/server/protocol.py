"""The HTTP/1.1 server protocol: uvicorn's httptools protocol, with limits on what a client sends before its body.

Like nginx's `large_client_header_buffers`, `client_header_timeout` and `client_body_timeout`:
- the request head (request line and headers) is capped at `limits.max_header_bytes`: over it, 431;
- a head must arrive within `limits.header_timeout_s` of its first byte (or of the connection opening): 408;
- a body may not pause for longer than `limits.body_timeout_s`: 408.
- at the file-descriptor limit (two sockets a stream: its client's and its upstream's), a request on a connection
  accepted past what the limit allows gets a 503 with `retry-after` instead of a reset at accept.
Requests the parser rejects (a bad content-length, a NUL in a header, an unknown method) get a 400. Every one
of these answers is in OpenAI's error format, with `connection: close`.

The common request, whose head and body come in one read, arms no timer: a timer is armed only when a read
ends in the middle of a head or a body, so the cost per request is a few attribute checks.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import httptools
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
from gateway.server.direct import NOTHING, Direct, Handler, body_bytes, failed, head_bytes, unanswered
from gateway.server.loop import running_loop
from gateway.server.reply import BODY_FOLLOWS
from gateway.server.request import ARRIVED, new_request_id, usable_id
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


class HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a head that is over the limit."""


class OutOfDescriptors(Exception):
    """Raised from a parser callback for a request on a connection that the descriptor limit cannot carry."""


@functools.cache
def connection_cap() -> int:
    """Client connections the soft descriptor limit carries, each with an upstream socket; read once, after
    `sluice serve` raised the limit (the protocol is made only once the server runs)."""
    return max((descriptors.soft_limit() - RESERVED_FDS) // 2, 1)


class GatewayProtocol(HttpToolsProtocol):
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
        self.max_head = limits.max_header_bytes
        self.header_timeout = limits.header_timeout_s
        self.body_timeout = limits.body_timeout_s
        self.in_head = True  # between requests, or in a head: not in a body
        self.in_body = False  # the head is complete, the body is not
        self.head_bytes = 0  # received in reads that ended inside the current head
        self.big_read = False  # the last read was larger than max_head: measure the head when it completes
        self.last_read = 0.0  # loop.time() of the last read, for the body timeout
        self.timer: asyncio.TimerHandle | None = None
        self.over_cap = False  # accepted past what the descriptor limit carries: its requests get 503
        self.arrived = 0.0  # perf_counter() when the current request's first byte was read
        self.request_id: bytes | None = None  # the current request's own x-request-id, if usable
        self.encoding = b""  # its content-encoding, lower-cased
        self.idle_since: float | None = None  # loop.time() when the last response ended, until bytes come
        # Set by the task that served this connection's last request on a proxy route and waits for its next.
        self.next_request: asyncio.Future[tuple[Direct, Handler] | None] | None = None
        # Where the app serves a proxy route without ASGI: the handler for a path, or None for the ASGI app.
        # Not with what only the ASGI cycle does: uvicorn's access log, a root path, a concurrency limit.
        route = getattr(self.app, "direct_route", None)
        plain_server = not self.access_log and not self.root_path and self.limit_concurrency is None
        self.route: Callable[[bytes], Handler | None] | None = route if plain_server else None

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
            self.over_cap = True
            if not GatewayProtocol.warned:
                GatewayProtocol.warned = True
                log.warning(
                    "file descriptors: %d client connections open, the most a soft limit of %d carries (two "
                    "sockets a stream); requests on connections past it get 503 with retry-after "
                    "(logged once; raise the limit: systemd LimitNOFILE, ulimit -n, the container's nofile)",
                    connection_cap(),
                    descriptors.soft_limit(),
                )
        self._arm(self.header_timeout)  # a connection that never sends a head is not held forever

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.idle_since = None
        waiter, self.next_request = self.next_request, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)  # the task waiting for this connection's next request ends
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None
        super().connection_lost(exc)

    # The keep-alive timeout, as uvicorn's but without a timer armed after every response and cancelled by the
    # next request (about 7k instructions a request): the time the connection fell idle is noted, and one timer
    # a connection, armed when none is, closes it if it is still idle when due, else waits the rest.
    def on_response_complete(self) -> None:
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:  # a pipelined request waited for this response to end
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self.idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self._keep_alive_due)

    def _unset_keepalive_if_required(self) -> None:
        self.idle_since = None  # bytes came: not idle; the timer, if armed, finds that when due

    def _keep_alive_due(self) -> None:
        self.timeout_keep_alive_task = None
        since = self.idle_since
        if since is None or self.transport.is_closing():
            return  # a request is under way: the timer is armed again when its response is complete
        left = since + self.timeout_keep_alive - self.loop.time()
        if left > 0:
            self.timeout_keep_alive_task = self.loop.call_later(left, self._keep_alive_due)
        else:
            self.timeout_keep_alive_handler()

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        if self.in_head:
            self.head_bytes += len(data)
            self.big_read = len(data) > self.max_head
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, OutOfDescriptors):
                message = "the gateway is at its file-descriptor limit; retry shortly"
                self._reject(503, message, "gateway_overloaded", retry_after=True)
            elif isinstance(exc.__context__, HeadTooLarge):
                self._reject(431, f"request head larger than {self.max_head} bytes", "request_header_too_large")
            else:
                self._reject(400, f"invalid HTTP request: {exc}", "invalid_http_request")
            return
        # Only a read that ends inside a head or a body needs a timer; most requests come whole.
        if self.in_head:
            if self.head_bytes > self.max_head:
                self._reject(431, f"request head larger than {self.max_head} bytes", "request_header_too_large")
            elif self.head_bytes and self.timer is None:
                self._arm(self.header_timeout)
        elif self.in_body:
            self.last_read = self.loop.time()
            if self.timer is None:
                self._arm(self.body_timeout)

    def on_message_begin(self) -> None:
        # Called by the parser within the read that holds the request's first byte: the overhead starts here.
        # The ASGI scope is made only for a request that goes to the ASGI app (_scope).
        self.arrived = time.perf_counter()
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self.request_id = None
        self.encoding = b""

    def on_header(self, name: bytes, value: bytes) -> None:
        # uvicorn's, noting on the way what the direct path would otherwise look for in the list again.
        name = name.lower()
        if name == b"expect":
            if value.lower() == b"100-continue":
                self.expect_100_continue = True
        elif name == b"x-request-id":
            if self.request_id is None and usable_id(value):
                self.request_id = value  # the first usable one, as request.request_id takes it
        elif name == b"content-encoding":
            self.encoding = value.strip().lower()  # the last one, as request.read_body takes it
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.over_cap:
            if len(self.server_state.connections) > connection_cap():
                raise OutOfDescriptors
            self.over_cap = False  # others closed meanwhile: this one can be served
        # Reads that ended inside the head were counted as they came. A head that completes in a read which
        # takes the count over the limit (one read larger than it, or the last of several whose total is) is
        # measured here, since that read may also hold the body: rare, past 64 KiB by default.
        suspect = self.big_read or self.head_bytes > self.max_head
        if suspect and len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers) > self.max_head:
            raise HeadTooLarge
        self.in_head = False
        self.in_body = True
        self.head_bytes = 0
        self._disarm()
        parser = self.parser
        if self.route is not None and parser.get_method() == b"POST" and not parser.should_upgrade():
            handler = self.route(self.url.partition(b"?")[0])
            if handler is not None:
                self._direct(handler, parser.get_http_version() != "1.0" and parser.should_keep_alive())
                return
        self.scope = self._scope()
        super().on_headers_complete()

    def _direct(self, handler: Handler, keep_alive: bool) -> None:
        """A request on a proxy route: the pipeline answers it on the transport, without the ASGI cycle."""
        previous = self.cycle
        cycle = Direct(
            self.transport,
            self.flow,
            self.headers,
            self.arrived,
            self.server_state.default_headers,
            self.request_id,
            self.encoding,
            keep_alive,
            self.expect_100_continue,
            self.on_response_complete,
        )
        self.cycle = cycle  # type: ignore[assignment]
        if previous is None or previous.response_complete:
            self._start_direct(cycle, handler)
        else:  # pipelined behind a response still going out: started when it is complete (on_response_complete)
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, handler))  # type: ignore[arg-type]

    # A task a request cost about 23k instructions (made, scheduled, its done-callback, uvicorn's task set): a
    # keep-alive connection's requests on proxy routes are served by a task that, once its request has ended
    # (its completion work included), waits for the connection's next one, which costs a future's wake-up,
    # about half. A request that arrives while no task waits (the first, or one behind a request still busy
    # after its response) gets a task of its own, so that none waits for another's completion work; of the
    # tasks that finish, one at most stays to wait.
    def _start_direct(self, cycle: Direct, handler: Handler) -> None:
        waiter = self.next_request
        if waiter is not None:
            self.next_request = None
            if not waiter.done():
                waiter.set_result((cycle, handler))
                return
        task = self.loop.create_task(self._serve_direct(cycle, handler))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    async def _serve_direct(self, cycle: Direct, handler: Handler) -> None:
        task = asyncio.current_task(self.loop)  # the loop given: not asked for (server/loop.py)
        assert task is not None
        while True:
            # The handler awaited in this frame (no wrapper of its own: tests/integration/gateway/test_frames.py);
            # what it leaves unanswered is ended as uvicorn's cycle ends it.
            try:
                await handler(cycle)
            except BaseException as exc:
                await failed(cycle, exc)
            else:
                if not cycle.response_complete:
                    await unanswered(cycle)
            finally:
                cycle.on_response = NOTHING
            del cycle, handler  # nothing of a finished request is held while the connection is idle
            if self.next_request is not None or self.transport.is_closing() or task.cancelling():
                return  # another task waits for the next request already, or there will be none
            waiter: asyncio.Future[tuple[Direct, Handler] | None] = self.loop.create_future()
            self.next_request = waiter
            try:
                following = await waiter
            except asyncio.CancelledError:  # the server's shutdown, once its grace is over
                if self.next_request is waiter:
                    self.next_request = None
                if waiter.done() and not waiter.cancelled() and (handed := waiter.result()) is not None:
                    handed[0].transport.close()  # a request handed over as the shutdown cut in: not served
                return
            if following is None:
                return  # the connection was lost
            cycle, handler = following

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

    def on_body(self, body: bytes) -> None:
        cycle: Any = self.cycle
        if type(cycle) is Direct:
            if not cycle.response_complete:
                cycle.feed(body)
        else:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self.in_head = True
        self.in_body = False
        self._disarm()
        cycle: Any = self.cycle
        if type(cycle) is Direct:
            if not cycle.response_complete:
                cycle.ended()
        else:
            super().on_message_complete()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        if type(cycle) is Direct:  # a pipelined request on a proxy route, its turn come
            self._start_direct(cycle, app)
            return
        cycle.__class__ = Cycle  # made by uvicorn's on_headers_complete; it has not run yet
        super()._start_asgi_task(cycle, app)

    def send_400_response(self, msg: str) -> None:
        self._reject(400, msg, "invalid_http_request")

    def _arm(self, delay: float) -> None:
        self.timer = self.loop.call_later(delay, self._expired)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expired(self) -> None:
        self.timer = None
        if self.transport.is_closing():
            return
        responding = self.cycle is not None and not self.cycle.response_complete and self.cycle.response_started
        if self.in_body:
            quiet = self.loop.time() - self.last_read
            if quiet < self.body_timeout:
                self._arm(self.body_timeout - quiet)  # the body moved since the timer was armed
            elif responding or (self.cycle is not None and self.cycle.response_complete):
                self.transport.close()  # answered already (a 413 from content-length): just stop waiting
            else:
                self._reject(408, f"request body stalled for {self.body_timeout:g} s", "request_timeout")
        elif responding:
            self._arm(self.header_timeout)  # the previous response is still going out; check again later
        elif self.head_bytes or self.cycle is None:
            self._reject(408, f"request head not received within {self.header_timeout:g} s", "request_timeout")
        else:
            self.transport.close()  # an idle keep-alive connection: uvicorn's own keep-alive timeout covers it

    def _reject(self, status: int, message: str, code: str, retry_after: bool = False) -> None:
        log.debug("rejected a request from %s: %s", self.client, message)
        self._disarm()
        kind = "server_error" if status >= 500 else "invalid_request_error"
        body = errors.GatewayError(message, status=status, type=kind, code=code).body()
        head = b"HTTP/1.1 %d %s\r\n" % (status, REASONS[status])
        head += b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n" % len(body)
        if retry_after:
            head += b"retry-after: %d\r\n" % RETRY_AFTER_S
        head += b"x-request-id: " + new_request_id().encode() + b"\r\n\r\n"
        self.transport.write(head + body)
        self.transport.close()
