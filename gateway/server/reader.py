"""What a client connection's parser reads, turned into requests: the parser's callbacks, the limits on a head
and a body, the keep-alive timer, and the task that serves the connection's requests on proxy routes.

The HTTP/1.1 protocol (protocol.py) is uvicorn's httptools protocol, a class the compiled build cannot compile
(mypyc compiles no subclass of an interpreted class). Everything a request passes through on its way from the
socket to the pipeline lives here instead, in a plain class the compiled build makes native: the transport's
`data_received`, the parser's six callbacks and the response's end are this object's methods, handed to the
transport and the parser directly. A request for the ASGI app (every path but the proxy routes, a WebSocket
upgrade) is handed to the protocol's own code, with the head the parser read (`GatewayProtocol.asgi_head`).

The common request, whose head and body come in one read, arms no timer: a timer is armed only when a read
ends in the middle of a head or a body, so the cost per request is a few attribute checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import httptools

from gateway.server.direct import NOTHING, Direct, Handler, failed, unanswered
from gateway.server.request import usable_id
from gateway.settings import LimitSettings

REQUEST_TIMEOUT = "request_timeout"
TOO_LARGE = "request_header_too_large"


class HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a head that is over the limit."""


class OutOfDescriptors(Exception):
    """Raised from a parser callback for a request on a connection that the descriptor limit cannot carry."""


class Reader:
    """One client connection's requests, from the bytes read to the handler that answers each."""

    def __init__(self, protocol: Any, limits: LimitSettings, route: Callable[[bytes], Handler | None] | None) -> None:
        self.protocol = protocol  # the GatewayProtocol: uvicorn's state and the ASGI path
        self.loop: asyncio.AbstractEventLoop = protocol.loop
        self.tasks: set[asyncio.Task[None]] = protocol.tasks  # the server's, which its shutdown waits for
        self.pipeline: Any = protocol.pipeline  # uvicorn's queue of requests behind a response still going out
        self.server_state: Any = protocol.server_state
        self.keep_alive_s: float = protocol.timeout_keep_alive
        self.parser: Any = httptools.HttpRequestParser(self)
        # As uvicorn's: a response to the first of pipelined requests even when the client closed after them.
        with contextlib.suppress(AttributeError):  # httptools before 0.6.3
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.transport: Any = None  # set by connection_made
        self.flow: Any = None
        self.max_head = limits.max_header_bytes
        self.header_timeout = limits.header_timeout_s
        self.body_timeout = limits.body_timeout_s
        self.in_head = True  # between requests, or in a head: not in a body
        self.in_body = False  # the head is complete, the body is not
        self.head_bytes = 0  # received in reads that ended inside the current head
        self.big_read = False  # the last read was larger than max_head: measure the head when it completes
        self.last_read = 0.0  # loop.time() of the last read, for the body timeout
        self.timer: asyncio.TimerHandle | None = None
        self.keep_alive_timer: asyncio.TimerHandle | None = None
        self.over_cap = False  # accepted past what the descriptor limit carries: its requests get 503
        self.cap: Callable[[], int] = lambda: 0  # the connections the descriptor limit carries (protocol.py)
        # The current request, as the parser gives it.
        self.arrived = 0.0  # perf_counter() when its first byte was read
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.expect_100_continue = False
        self.request_id: bytes | None = None  # its own x-request-id, if usable
        self.encoding = b""  # its content-encoding, lower-cased
        self.cycle: Any = None  # the request being answered: a Direct, or uvicorn's cycle (as protocol.cycle)
        self.idle_since: float | None = None  # loop.time() when the last response ended, until bytes come
        # Set by the task that served this connection's last request on a proxy route and waits for its next.
        self.next_request: asyncio.Future[tuple[Direct, Handler] | None] | None = None
        # Where the app serves a proxy route without ASGI: its handlers by path (looked up here first), and the
        # app's own look-up for a path not among them; None: every request goes to the ASGI app.
        self.route = route
        routes = getattr(getattr(route, "__self__", None), "direct_routes", None)
        self.routes: dict[bytes, Handler] = routes if routes is not None else {}  # the app's own dict, filled later

    def connection_made(self, transport: Any, flow: Any) -> None:
        self.transport = transport
        self.flow = flow
        self.arm(self.header_timeout)  # a connection that never sends a head is not held forever

    def connection_lost(self) -> None:
        self.disarm()
        self.idle_since = None
        waiter, self.next_request = self.next_request, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)  # the task waiting for this connection's next request ends
        timer, self.keep_alive_timer = self.keep_alive_timer, None
        if timer is not None:
            timer.cancel()

    # The transport's callback.
    def data_received(self, data: bytes) -> None:
        self.idle_since = None  # bytes came: not idle; the keep-alive timer, if armed, finds that when due
        if self.in_head:
            self.head_bytes += len(data)
            self.big_read = len(data) > self.max_head
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.protocol.upgrade()
            return
        except httptools.HttpParserError as exc:
            context = exc.__context__
            if isinstance(context, OutOfDescriptors):
                message = "the gateway is at its file-descriptor limit; retry shortly"
                self.protocol.reject(503, message, "gateway_overloaded", True)
            elif isinstance(context, HeadTooLarge):
                self.protocol.reject(431, f"request head larger than {self.max_head} bytes", TOO_LARGE, False)
            else:
                self.protocol.reject(400, f"invalid HTTP request: {exc}", "invalid_http_request", False)
            return
        # Only a read that ends inside a head or a body needs a timer; most requests come whole.
        if self.in_head:
            if self.head_bytes > self.max_head:
                self.protocol.reject(431, f"request head larger than {self.max_head} bytes", TOO_LARGE, False)
            elif self.head_bytes and self.timer is None:
                self.arm(self.header_timeout)
        elif self.in_body:
            self.last_read = self.loop.time()
            if self.timer is None:
                self.arm(self.body_timeout)

    # The parser's callbacks.
    def on_message_begin(self) -> None:
        # Called by the parser within the read that holds the request's first byte: the overhead starts here.
        self.arrived = time.perf_counter()
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self.request_id = None
        self.encoding = b""

    def on_url(self, url: bytes) -> None:
        self.url += url

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
            if len(self.server_state.connections) > self.cap():
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
        if self.timer is not None:
            self.disarm()
        parser = self.parser
        if self.route is not None and parser.get_method() == b"POST" and not parser.should_upgrade():
            path = self.url.partition(b"?")[0]
            handler = self.routes.get(path)
            if handler is None:
                handler = self.route(path)
            if handler is not None:
                self.direct(handler, parser.get_http_version() != "1.0" and parser.should_keep_alive())
                return
        self.protocol.asgi_head(self.url, self.headers, self.expect_100_continue, self.arrived)
        self.cycle = self.protocol.cycle

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if type(cycle) is Direct:
            if not cycle.response_complete:
                cycle.feed(body)
        else:
            self.protocol.asgi_body(body)

    def on_message_complete(self) -> None:
        self.in_head = True
        self.in_body = False
        if self.timer is not None:
            self.disarm()
        cycle = self.cycle
        if type(cycle) is Direct:
            if not cycle.response_complete:
                cycle.ended()
        else:
            self.protocol.asgi_complete()

    # A request on a proxy route: the pipeline answers it on the transport, without the ASGI cycle.
    def direct(self, handler: Handler, keep_alive: bool) -> None:
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
            self.response_complete,
        )
        self.cycle = self.protocol.cycle = cycle  # uvicorn's connection_lost and shutdown read the protocol's
        if previous is None or previous.response_complete:
            self.start_direct(cycle, handler)
        else:  # pipelined behind a response still going out: started when it is complete (response_complete)
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, handler))

    # A task a request cost about 23k instructions (made, scheduled, its done-callback, uvicorn's task set): a
    # keep-alive connection's requests on proxy routes are served by a task that, once its request has ended
    # (its completion work included), waits for the connection's next one, which costs a future's wake-up,
    # about half. A request that arrives while no task waits (the first, or one behind a request still busy
    # after its response) gets a task of its own, so that none waits for another's completion work; of the
    # tasks that finish, one at most stays to wait.
    def start_direct(self, cycle: Direct, handler: Handler) -> None:
        waiter = self.next_request
        if waiter is not None:
            self.next_request = None
            if not waiter.done():
                waiter.set_result((cycle, handler))
                return
        task = self.loop.create_task(self.serve(cycle, handler))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    async def serve(self, cycle: Direct | None, handler: Handler | None) -> None:
        task = asyncio.current_task(self.loop)  # the loop given: not asked for (server/loop.py)
        assert task is not None
        while cycle is not None and handler is not None:
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
            if self.next_request is not None or self.transport.is_closing() or task.cancelling():
                return  # another task waits for the next request already, or there will be none
            waiter: asyncio.Future[tuple[Direct, Handler] | None] = self.loop.create_future()
            self.next_request = waiter
            cycle = handler = None  # nothing of a finished request is held while the connection is idle
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

    # The keep-alive timeout, as uvicorn's but without a timer armed after every response and cancelled by the
    # next request (about 7k instructions a request): the time the connection fell idle is noted, and one timer
    # a connection, armed when none is, closes it if it is still idle when due, else waits the rest.
    def response_complete(self) -> None:
        self.server_state.total_requests += 1
        transport = self.transport
        if transport.is_closing():
            return
        flow = self.flow
        if flow.read_paused:
            flow.resume_reading()
        if self.pipeline:  # a pipelined request waited for this response to end
            cycle, app = self.pipeline.pop()
            if type(cycle) is Direct:
                self.start_direct(cycle, app)
            else:
                self.protocol.start_asgi(cycle, app)
            return
        self.idle_since = self.loop.time()
        if self.keep_alive_timer is None:
            self.keep_alive_timer = self.loop.call_later(self.keep_alive_s, self.keep_alive_due)

    def keep_alive_due(self) -> None:
        self.keep_alive_timer = None
        since = self.idle_since
        if since is None or self.transport.is_closing():
            return  # a request is under way: the timer is armed again when its response is complete
        left = since + self.keep_alive_s - self.loop.time()
        if left > 0:
            self.keep_alive_timer = self.loop.call_later(left, self.keep_alive_due)
        else:
            self.transport.close()

    # The head and body timeouts.
    def arm(self, delay: float) -> None:
        self.timer = self.loop.call_later(delay, self.expired)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def expired(self) -> None:
        self.timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        responding = cycle is not None and not cycle.response_complete and cycle.response_started
        if self.in_body:
            quiet = self.loop.time() - self.last_read
            if quiet < self.body_timeout:
                self.arm(self.body_timeout - quiet)  # the body moved since the timer was armed
            elif responding or (cycle is not None and cycle.response_complete):
                self.transport.close()  # answered already (a 413 from content-length): just stop waiting
            else:
                message = f"request body stalled for {self.body_timeout:g} s"
                self.protocol.reject(408, message, REQUEST_TIMEOUT, False)
        elif responding:
            self.arm(self.header_timeout)  # the previous response is still going out; check again later
        elif self.head_bytes or cycle is None:
            message = f"request head not received within {self.header_timeout:g} s"
            self.protocol.reject(408, message, REQUEST_TIMEOUT, False)
        else:
            self.transport.close()  # an idle keep-alive connection: uvicorn's own keep-alive timeout covers it
