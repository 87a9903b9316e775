"""The upstream connection pool used on the request path.

HTTP/1.1 keep-alive over asyncio protocols, responses parsed by httptools. It exists because a general
client's request/response layer costs more CPU per request than the rest of the gateway together
(docs/architecture.md has the measurements). It does only what a proxy needs:

- one `Pool` per origin, with a hard cap on connections and a cap on the idle ones kept;
- connections opened (TCP and TLS) by `warm()` at start-up and topped up by `maintain()`;
- a request is written in one `transport.write`; the response head resolves `request()`, the body is
  read with `Response.next_chunk()`, which returns all that has arrived so far (chunked framing already
  removed by httptools);
- timeouts for connect, pool acquisition, first byte and idle gaps between body chunks;
- back-pressure: when the reader falls behind, the socket stops being read until it catches up;
- a connection goes back to the pool only after a complete response; anything else closes it.

Errors are `PoolError` subclasses; `gateway/errors.py` maps them to HTTP statuses in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

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


@dataclass(frozen=True, slots=True)
class Origin:
    scheme: str
    host: str
    port: int

    @classmethod
    def from_url(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port)

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal
        return host if self.port == default else f"{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class PoolLimits:
    max_connections: int = 1024
    max_idle: int = 64
    warm: int = 4
    connect_timeout: float = 5.0
    pool_timeout: float = 10.0
    first_byte_timeout: float = 600.0
    idle_read_timeout: float = 600.0
    keepalive_expiry: float = 30.0


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


class Pool:
    """Keep-alive connections to one origin."""

    def __init__(self, url: str, limits: PoolLimits, ssl_context: ssl.SSLContext | None = None) -> None:
        self.origin = Origin.from_url(url)
        self.limits = limits
        self.loop = asyncio.get_running_loop()
        if self.origin.scheme == "https":
            self.ssl: ssl.SSLContext | None = ssl_context or ssl.create_default_context()
        else:
            self.ssl = None
        self._idle: deque[Connection] = deque()
        self._all: set[Connection] = set()
        self._opening = 0
        self._waiters: deque[asyncio.Future[Connection]] = deque()
        self._handovers: set[asyncio.Task[Connection]] = set()
        self._closed = False
        self.host_line = f"host: {self.origin.host_header}\r\n".encode("latin-1")

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def size(self) -> int:
        return len(self._all)

    @property
    def busy(self) -> int:
        """Requests in flight here: connections in use, being opened, or waited for."""
        return len(self._all) - len(self._idle) + self._opening + len(self._waiters)

    async def warm(self, count: int | None = None) -> int:
        """Open connections until `count` (default: limits.warm) are idle; return how many are idle.

        Raises the first failure when connections were wanted and none could be opened.
        """
        want = min(self.limits.warm if count is None else count, self.limits.max_idle)
        room = self.limits.max_connections - len(self._all) - self._opening
        missing = min(want - len(self._idle), room)
        failure: PoolError | None = None
        if missing > 0:
            results = await asyncio.gather(*(self._open() for _ in range(missing)), return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    if not isinstance(result, PoolError):
                        raise result
                    failure = failure or result
                else:
                    self._release(result)
        if failure is not None and not self._idle and not self._all:
            raise failure
        return len(self._idle)

    def expire(self) -> None:
        """Close the idle connections unused for longer than the keep-alive expiry."""
        cutoff = time.monotonic() - self.limits.keepalive_expiry
        for conn in [c for c in self._idle if c.idle_since < cutoff]:
            conn.abort()

    async def maintain(self, interval: float) -> None:
        """Close expired idle connections and keep `limits.warm` open; runs until cancelled."""
        while not self._closed:
            await asyncio.sleep(interval)
            self.expire()
            with contextlib.suppress(PoolError):
                await self.warm()

    async def request(self, method: bytes, target: bytes, headers: bytes, body: bytes) -> Response:
        """Send one request; return when the response head has arrived.

        `headers` holds serialised header lines (b"name: value\\r\\n"...), without host or content-length.
        """
        data = b"".join(
            (
                method,
                b" ",
                target,
                b" HTTP/1.1\r\n",
                self.host_line,
                headers,
                b"content-length: ",
                str(len(body)).encode(),
                b"\r\n\r\n",
                body,
            )
        )
        started = time.perf_counter()
        idle = self._idle
        conn = idle.pop() if idle else None  # the common case, as _acquire takes it, without its awaited frame
        if conn is not None and not conn.closed:
            conn.reused = True
        else:
            conn = await self._acquire()
        waited = time.perf_counter() - started
        try:
            response = await self._exchange(conn, data)
        except RemoteProtocolError:
            # A reused connection the upstream had already closed, before it answered a byte: the request
            # never reached the application, so one more try on a fresh connection is safe.
            if not (conn.reused and not conn.got_bytes):
                raise
            started = time.perf_counter()
            conn = await self._acquire(fresh=True)
            waited += time.perf_counter() - started
            response = await self._exchange(conn, data)
        response.acquire_ms = waited * 1000.0
        return response

    async def _exchange(self, conn: Connection, data: bytes) -> Response:
        head = conn.send(data)
        conn.head_due(self.limits.first_byte_timeout)
        try:
            return await head
        except asyncio.CancelledError:
            conn.abort()
            raise
        finally:
            conn.head_by = 0.0

    async def _acquire(self, fresh: bool = False) -> Connection:
        """An idle connection, else a new one within max_connections, else the next one freed."""
        idle = self._idle
        while idle and not fresh:
            conn = idle.pop()
            if not conn.closed:
                conn.reused = True
                return conn
        if len(self._all) + self._opening < self.limits.max_connections:
            return await self._open()
        waiter: asyncio.Future[Connection] = self.loop.create_future()
        self._waiters.append(waiter)
        timer = self.loop.call_later(self.limits.pool_timeout, self._pool_expired, waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            # Cancelled after a connection was handed over but before this task resumed: give it back.
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._release(waiter.result())
            raise
        finally:
            timer.cancel()

    def _pool_expired(self, waiter: asyncio.Future[Connection]) -> None:
        if not waiter.done():
            waiter.set_exception(PoolTimeout("no upstream connection free within the pool timeout"))
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    async def _open(self, reserved: bool = False) -> Connection:
        """A new connection; `reserved` when the caller has already counted it in `_opening`."""
        if not reserved:
            self._opening += 1
        try:
            if self._closed:
                raise ConnectError("pool is closed")
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: Connection(self),
                    self.origin.host,
                    self.origin.port,
                    ssl=self.ssl,
                    server_hostname=self.origin.host if self.ssl else None,
                ),
                self.limits.connect_timeout,
            )
        except TimeoutError as exc:
            raise ConnectTimeout(f"connect to {self.origin.host_header} timed out") from exc
        except (OSError, ssl.SSLError) as exc:
            if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
                raise DescriptorsExhausted(f"no file descriptor left to connect to {self.origin.host_header}") from exc
            raise ConnectError(f"cannot connect to {self.origin.host_header}: {exc}") from exc
        finally:
            self._opening -= 1
        if self._closed:
            conn.abort()
            raise ConnectError("pool is closed")
        if conn.closed:  # the upstream accepted and closed at once; it would never answer on this one
            raise ConnectError(f"connection to {self.origin.host_header} closed as it opened")
        self._all.add(conn)
        return conn

    def _release(self, conn: Connection) -> None:
        if conn.closed or self._closed:
            conn.abort()
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                conn.reused = True
                waiter.set_result(conn)
                return
        if len(self._idle) >= self.limits.max_idle:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def _forget(self, conn: Connection) -> None:
        # Called by abort() and again by connection_lost(): only the first call frees a slot.
        if conn not in self._all:
            return
        self._all.remove(conn)
        with contextlib.suppress(ValueError):
            self._idle.remove(conn)
        # A slot opened: the first waiter still waiting may now open a fresh connection.
        while self._waiters and not self._closed:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._opening += 1  # counted now, so that no other request takes the slot meanwhile
                task = self.loop.create_task(self._open(reserved=True))
                self._handovers.add(task)
                task.add_done_callback(functools.partial(_hand_over, waiter=waiter, pool=self))
                return

    async def aclose(self) -> None:
        self._closed = True
        for conn in list(self._all):
            conn.abort()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(ConnectError("pool is closed"))
        self._waiters.clear()
        for task in list(self._handovers):
            task.cancel()
        await asyncio.gather(*self._handovers, return_exceptions=True)
        # One turn of the loop runs the transports' connection_lost, which closes their sockets.
        await asyncio.sleep(0)


def _hand_over(task: asyncio.Task[Connection], waiter: asyncio.Future[Connection], pool: Pool) -> None:
    pool._handovers.discard(task)
    if task.cancelled():
        if not waiter.done():
            waiter.cancel()
        return
    exc = task.exception()
    if exc is not None:
        if not waiter.done():
            waiter.set_exception(exc)
        return
    conn = task.result()
    if waiter.done():
        pool._release(conn)
    else:
        conn.reused = False
        waiter.set_result(conn)
