"""A WebSocket to an upstream's Responses API (OpenAI's and Azure's WebSocket mode): the client side.

One `UpstreamSocket` is one connection, opened for one client socket and kept for it (gateway/responses/pinned.py):
the upstream's connection-local cache (the last response, continued with `previous_response_id` alone) is per
connection. Framing is wsproto's (sans-io, already a dependency for the server side) on an asyncio protocol, as
the HTTP pool is: no extra task per connection, pings answered where the bytes arrive, no compression.

A turn (`SocketTurn`) is one `response.create` sent and its events read back; it looks like a streamed HTTP
response to the attempt loop and the relay: `next_chunk()` gives every message that arrived since the last call,
each framed as an SSE event (`data: ...` and a blank line), so that the relay's first-token, usage and end
observation, the Responses index and the socket responder read it as they read an SSE stream. The first
message is awaited before `create()` returns, like an HTTP head: an `error` event there becomes the turn's
status (a 429 or a 5xx may still go to the next target, a 4xx is answered), anything else is status 200. A turn
ends at its terminal event (`response.completed`, `.incomplete`, `.failed`) or an `error`; one turn at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
from collections import deque
from typing import Any
from urllib.parse import urlsplit

import orjson
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from gateway.upstream.pool import ConnectError, ConnectTimeout, PoolError, ReadTimeout, ResponseClosed

ENDS = (b'"response.completed"', b'"response.incomplete"', b'"response.failed"', b'"error"')
TYPE_ERROR = re.compile(rb'^\s*\{\s*"type"\s*:\s*"error"')
RESPONSE_ID = re.compile(rb'"response"\s*:\s*\{\s*"id"\s*:\s*"(resp_[A-Za-z0-9_-]{1,128})"')


class SocketRefused(ConnectError):
    """The upstream answered the upgrade with an HTTP status: it does not serve the WebSocket mode here (4xx), or
    not now (5xx)."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"the upstream refused the WebSocket upgrade with {status}: {body[:200]!r}")
        self.status = status


class SocketClosed(PoolError):
    """The upstream socket closed (or broke) before the turn ended."""


class SocketTurn:
    """One `response.create` on an upstream socket, read as a streamed response (see the module's docstring)."""

    __slots__ = (
        "_socket",
        "_waiter",
        "acquire_ms",
        "complete",
        "ended",
        "error",
        "error_body",
        "headers",
        "messages",
        "status",
    )

    def __init__(self, socket: UpstreamSocket) -> None:
        self._socket = socket
        self.messages: deque[bytes] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.status = 200
        self.headers: list[tuple[bytes, bytes]] = [(b"content-type", b"text/event-stream")]
        self.complete = False  # the terminal event has been read
        self.ended = False  # the terminal event has arrived
        self.error: PoolError | None = None
        self.error_body = b""  # an error event's `{"error": ...}`, when the turn's status is one
        self.acquire_ms = 0.0

    def _arrived(self, message: bytes) -> None:
        self.messages.append(message)
        if any(end in message[:96] for end in ENDS):
            self.ended = True
        self._wake()

    def _failed(self, error: PoolError) -> None:
        if not self.ended:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self, timeout: float | None) -> None:
        while not self.messages and self.error is None and not self.ended:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout):
                    await waiter
            except TimeoutError:
                raise ReadTimeout("the upstream socket sent nothing in time") from None
            finally:
                self._waiter = None

    async def next_chunk(self) -> bytes:
        """The messages that arrived since the last call, as SSE events; b"" after the terminal one."""
        if self.complete:
            return b""
        if not self.messages:
            await self._wait(self._socket.idle_read_s)
        if not self.messages:
            if self.error is not None:
                raise self.error
            return b""
        messages = self.messages
        parts = [b"data: " + messages.popleft() + b"\n\n"]
        while messages:
            parts.append(b"data: " + messages.popleft() + b"\n\n")
        if self.ended and not messages:
            self.complete = True
            self._socket.turn = None
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def read(self) -> bytes:
        if self.status >= 400:
            return self.error_body
        parts = []
        while chunk := await self.next_chunk():
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        """An unfinished turn cannot be stopped on a shared stream of events: the socket is closed with it."""
        if not self.complete:
            self.error = self.error or ResponseClosed("turn closed")
            self._socket.abort()
            self._wake()


class UpstreamSocket(asyncio.Protocol):
    """One WebSocket connection to an upstream `/responses`."""

    def __init__(self, idle_read_s: float | None) -> None:
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.transport: asyncio.Transport | None = None
        self.idle_read_s = idle_read_s
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.rejected: tuple[int, bytearray] | None = None
        self.parts: list[str] = []  # a text message that arrives in several frames
        self.turn: SocketTurn | None = None
        self.closed = False
        self.last: str | None = None  # the id of the last response made on this socket: its connection-local cache
        self.turns = 0

    @classmethod
    async def open(
        cls,
        url: str,
        headers: list[tuple[bytes, bytes]],
        context: ssl.SSLContext | None,
        connect_timeout: float,
        idle_read_s: float | None,
    ) -> UpstreamSocket:
        """Connect and upgrade; raises ConnectError (SocketRefused for an HTTP answer) when it cannot be had."""
        parts = urlsplit(url)
        secure = parts.scheme in ("https", "wss")
        host = parts.hostname or "localhost"
        port = parts.port or (443 if secure else 80)
        loop = asyncio.get_running_loop()
        target = parts.path + ("?" + parts.query if parts.query else "")
        try:
            async with asyncio.timeout(connect_timeout):
                _, socket = await loop.create_connection(
                    lambda: cls(idle_read_s), host, port, ssl=context if secure else None
                )
                authority = host if parts.port is None else f"{host}:{port}"
                socket._write(socket.ws.send(Request(host=authority, target=target, extra_headers=headers)))
                await socket.opened
        except TimeoutError:
            raise ConnectTimeout(f"the upstream WebSocket {url} was not open within {connect_timeout:g} s") from None
        except OSError as exc:
            raise ConnectError(f"the upstream WebSocket {url}: {exc}") from None
        return socket

    # asyncio's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass of asyncio's

    def data_received(self, data: bytes) -> None:
        try:
            self.ws.receive_data(data)
            for event in self.ws.events():
                self._event(event)
        except (LocalProtocolError, RemoteProtocolError) as exc:
            self._lost(SocketClosed(f"the upstream socket broke the WebSocket protocol: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(SocketClosed(f"the upstream socket closed{f': {exc}' if exc else ''}"))

    def _event(self, event: Any) -> None:
        if isinstance(event, TextMessage):
            if not event.message_finished:
                self.parts.append(event.data)
                return
            text = "".join((*self.parts, event.data)) if self.parts else event.data
            self.parts.clear()
            self._message(text.encode())
        elif isinstance(event, Ping):
            self._write(self.ws.send(event.response()))
        elif isinstance(event, AcceptConnection):
            if not self.opened.done():
                self.opened.set_result(None)
        elif isinstance(event, RejectConnection):
            self.rejected = (event.status_code, bytearray())
            if not event.has_body:
                self._refused()
        elif isinstance(event, RejectData):
            if self.rejected is not None:
                self.rejected[1].extend(event.data)
                if event.body_finished:
                    self._refused()
        elif isinstance(event, CloseConnection):
            if self.ws.state is ConnectionState.REMOTE_CLOSING:
                self._write(self.ws.send(event.response()))
            self._lost(SocketClosed(f"the upstream closed its socket ({event.code} {event.reason})"))
        # Pongs and binary messages carry nothing for a turn.

    def _refused(self) -> None:
        assert self.rejected is not None
        status, body = self.rejected
        if not self.opened.done():
            self.opened.set_exception(SocketRefused(status, bytes(body)))
        self.abort()

    def _message(self, message: bytes) -> None:
        turn = self.turn
        if turn is None:
            return  # nothing asked for it (an event after a turn was given up): dropped
        if self.last is None:
            found = RESPONSE_ID.search(message, 0, 256)
            if found is not None:
                self.last = found.group(1).decode()
        turn._arrived(message)

    def _lost(self, error: PoolError) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.opened.done():
            self.opened.set_exception(ConnectError(str(error)))
        if self.turn is not None:
            self.turn._failed(error)
            self.turn = None
        if self.transport is not None:
            self.transport.close()

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    # the gateway's side

    @property
    def usable(self) -> bool:
        return not self.closed and self.turn is None

    async def create(self, body: bytes, timeout: float | None) -> SocketTurn:
        """Send one `response.create` (its JSON) and wait for the first event: the turn, with an error event as
        its status. Raises SocketClosed if the socket is gone before that."""
        if not self.usable:
            raise SocketClosed("the upstream socket is closed or busy")
        turn = self.turn = SocketTurn(self)
        self.turns += 1
        self.last = None  # the connection's cache now holds what this turn makes
        self._write(self.ws.send(TextMessage(data=body.decode())))
        try:
            await turn._wait(timeout)
        except BaseException:
            turn.close()
            raise
        if not turn.messages:
            raise turn.error or SocketClosed("the upstream socket closed")
        first = turn.messages[0]
        if TYPE_ERROR.match(first):
            turn.status, turn.error_body = _error(first)
            turn.messages.clear()
            turn.complete = True
            self.turn = None
        return turn

    def abort(self) -> None:
        """Close now: a half-read turn leaves the socket's stream of events out of step."""
        if not self.closed:
            with contextlib.suppress(LocalProtocolError):
                self._write(self.ws.send(CloseConnection(code=1000)))
            self._lost(SocketClosed("the upstream socket was closed by the gateway"))


def _error(message: bytes) -> tuple[int, bytes]:
    """An error event as an HTTP error answer: its status (400 if it has none) and `{"error": ...}`."""
    try:
        event = orjson.loads(message)
    except orjson.JSONDecodeError:
        return 502, orjson.dumps({"error": {"message": message[:500].decode("utf-8", "replace"), "type": "api_error"}})
    status = event.get("status")
    error = event.get("error")
    if not isinstance(error, dict):
        error = {"message": str(error), "type": "api_error"}
    return (status if isinstance(status, int) and 400 <= status < 600 else 400), orjson.dumps({"error": error})
