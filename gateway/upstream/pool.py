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

A connection and its response are connection.py's; the transport errors too, `PoolError` subclasses that
`gateway/upstream/attempts.py` maps to HTTP statuses in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import ssl
import time
from collections import deque
from dataclasses import dataclass
from urllib.parse import urlsplit

from gateway.upstream.connection import (
    ConnectError,
    Connection,
    ConnectTimeout,
    DescriptorsExhausted,
    PoolError,
    PoolTimeout,
    RemoteProtocolError,
    Response,
)


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
        except TimeoutError as late:  # named apart: compiled, a name bound by two clauses has one type
            raise ConnectTimeout(f"connect to {self.origin.host_header} timed out") from late
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
