"""One keep-alive connection to an upstream and the response read from it: the pool's parts (pool.py).

The connection is an asyncio protocol fed by the transport; httptools calls its on_* methods as it parses the
response, whose body `Response.next_chunk()` hands out as it arrives, with back-pressure on the socket. The
transport errors are `PoolError` subclasses; `gateway/upstream/attempts.py` maps them to statuses in one place.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import httptools

if TYPE_CHECKING:
    from gateway.upstream.pool import Pool

# Stop reading the socket when this much body is buffered and unread; resume below the low mark.
HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024


class PoolError(Exception):
    """Base of everything the pool raises."""


class ConnectError(PoolError):
    """The TCP or TLS connection could not be made."""


class ConnectTimeout(ConnectError):
    """The TCP or TLS connection was not made within the connect timeout."""


class DescriptorsExhausted(PoolError):
    """This process is at its file-descriptor limit: no socket can be opened, to this upstream or any other.

    Not a ConnectError: the upstream is not at fault, so it is neither marked down nor retried elsewhere.
    """


class PoolTimeout(PoolError):
    """No connection became free within the pool timeout."""


class ReadTimeout(PoolError):
    """The upstream sent nothing for longer than the first-byte or idle-read timeout."""


class RemoteProtocolError(PoolError):
    """The upstream closed the connection early or sent something that is not HTTP/1.1."""


class ResponseClosed(PoolError):
    """The response was closed by the gateway (client gone, deadline passed) while being read."""


async def read_all(next_chunk: Callable[[], Awaitable[bytes]]) -> bytes:
    """A whole body from a `next_chunk` that returns b"" at its end; every response kind reads this way."""
    parts = []
    while chunk := await next_chunk():
        parts.append(chunk)
    return b"".join(parts)


class Response:
    """One upstream response: the head is known, the body arrives through `next_chunk()`."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_error",
        "_waiter",
        "acquire_ms",
        "complete",
        "headers",
        "status",
    )

    def __init__(self, conn: Connection) -> None:
        self._conn: Connection | None = conn
        self.acquire_ms = 0.0  # waiting for a connection (opening one included), set by Pool.request
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        # A list, not a deque: it is emptied whole at every read, and an empty deque costs 760 bytes against a
        # list's 56, for as long as the response lives (10,000 open streams: 7 MB).
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: PoolError | None = None
        self.complete = False

    async def next_chunk(self) -> bytes:
        """The next piece of the body, or b"" once the body is complete. Raises PoolError on failure."""
        while True:
            chunks = self._chunks
            if chunks:
                # Everything that has already arrived goes out as one piece: one write to the client
                # instead of one per upstream chunk, and no chunk waits for anything that has not arrived.
                chunk = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                if self._conn is not None:
                    self._conn.resume()
                return chunk
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            conn = self._conn
            if conn is None:  # pragma: no cover - closed responses always carry an error
                raise ResponseClosed("response closed")
            waiter = self._waiter = conn.loop.create_future()
            timer = conn.loop.call_later(conn.pool.limits.idle_read_timeout, self._expire, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None

    async def read(self) -> bytes:
        """The whole body."""
        return await read_all(self.next_chunk)

    def close(self) -> None:
        """Stop reading. A response whose body is not complete takes its connection down with it."""
        if self._error is None and not self.complete:
            self._fail(ResponseClosed("response closed before its end"))
        if not self.complete:
            # Never readable now: free what is buffered instead of holding it as long as the response lives.
            self._chunks.clear()
            self._buffered = 0
        conn = self._conn
        self._conn = None
        if conn is not None and conn.current is self:
            conn.abort()

    def _expire(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            self._fail(ReadTimeout("upstream idle for longer than the read timeout"))
            if self._conn is not None:
                self._conn.abort()

    def _feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered > HIGH_WATER and self._conn is not None:
            self._conn.pause()
        self._wake()

    def _finish(self) -> None:
        self.complete = True
        self._conn = None
        self._wake()

    def _fail(self, error: PoolError) -> None:
        if self._error is None and not self.complete:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class Connection(asyncio.Protocol):
    """One keep-alive connection; httptools calls the on_* methods while `data_received` feeds it."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.current: Response | None = None
        self.head: asyncio.Future[Response] | None = None
        self.closed = False
        self.paused = False
        self.reused = False
        self.got_bytes = False
        self.idle_since = time.monotonic()
        self.body_until_eof = False
        # The first-byte timeout without a timer armed and cancelled for every request (about 7k instructions
        # each): the deadline of the request waiting for its head (0: none), and one timer a connection,
        # armed when none is, which fails that request if its deadline has passed, else waits the rest.
        self.head_by = 0.0
        self.head_timer: asyncio.TimerHandle | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, though they behave as one.
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self.current is None:
            # Bytes outside any exchange: the connection can no longer be trusted.
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(RemoteProtocolError(f"malformed upstream response: {exc!r}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_head_timer()
        response = self.current
        if response is not None and response.status and self.body_until_eof and exc is None and not response._error:
            response._finish()  # the body of a response with no length ends with the connection
        elif response is not None or (self.head is not None and not self.head.done()):
            self._fail(RemoteProtocolError("upstream closed the connection before the response ended"))
        self.current = None
        self.pool._forget(self)

    # httptools callbacks

    def on_status(self, status: bytes) -> None:
        pass

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.current is not None
        self.current.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        response = self.current
        assert response is not None
        response.status = self.parser.get_status_code()
        framed = False
        for name, _ in response.headers:
            if name == b"content-length" or name == b"transfer-encoding":
                framed = True
                break
        self.body_until_eof = not framed and response.status not in (204, 304) and response.status >= 200
        head = self.head
        if head is not None and not head.done():
            head.set_result(response)

    def on_body(self, body: bytes) -> None:
        assert self.current is not None
        self.current._feed(body)

    def on_message_complete(self) -> None:
        response = self.current
        assert response is not None
        self.current = None
        keep = self.parser.should_keep_alive() and not self.body_until_eof
        response._finish()
        if keep:
            # The body may have completed in the very read that paused the socket; an idle connection must read.
            self.resume()
            self.pool._release(self)
        else:
            self.abort()

    # used by Response and Pool

    def send(self, data: bytes) -> asyncio.Future[Response]:
        assert self.transport is not None
        self.current = Response(self)
        self.head = self.loop.create_future()
        self.got_bytes = False
        if self.closed or self.transport.is_closing():
            # Closed by the upstream, maybe with connection_lost still to come: asyncio would drop the write
            # and nothing would ever answer; uvloop would raise RuntimeError.
            self._fail(RemoteProtocolError("upstream closed the connection before the request was sent"))
            self.current = None
        else:
            self.transport.write(data)
        return self.head

    def head_due(self, timeout: float) -> None:
        """The request just sent must have its response head within `timeout` seconds."""
        self.head_by = self.loop.time() + timeout
        if self.head_timer is None:
            self.head_timer = self.loop.call_later(timeout, self._head_check)

    def _head_check(self) -> None:
        self.head_timer = None
        if not self.head_by or self.closed:
            return
        left = self.head_by - self.loop.time()
        if left > 0:
            self.head_timer = self.loop.call_later(left, self._head_check)
        else:
            self._fail(ReadTimeout("no response from upstream within the first-byte timeout"))
            self.abort()

    def _stop_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self._stop_head_timer()
            # Before connection_lost, which would otherwise take the end of a length-less body for its end.
            self._fail(ResponseClosed("connection closed by the gateway"))
            if self.transport is not None:
                self.transport.abort()
            self.pool._forget(self)

    def _fail(self, error: PoolError) -> None:
        head = self.head
        if head is not None and not head.done():
            head.set_exception(error)
            # Retrieved here so that asyncio never logs it when nobody awaits the head any more.
            head.exception()
        if self.current is not None:
            self.current._fail(error)
