"""A WebSocket to an upstream's Responses API (OpenAI's and Azure's WebSocket mode): the client side.

One `UpstreamSocket` is one connection, opened for one client socket and kept for it (gateway/responses/pinned.py):
the upstream's connection-local cache (the last response, continued with `previous_response_id` alone) is per
connection. It is an asyncio protocol, as the HTTP pool is: no task of its own, pings answered where the bytes
arrive. The framing is written here, for the one thing it carries: the handshake, unmasked text frames in (each
event's bytes passed on as they came: no UTF-8 decode and encode, no event objects) and masked text frames out,
pings, pongs and the close; no extension (no compression). Measured on this machine (load average 7), one turn's
16 frames (3 KB) read one per call: 45-51 us here, SSE framing and the turn's end found included; wsproto, which
the server side uses, 220-350 us for the frames' parse alone.

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
import base64
import hashlib
import os
import re
import ssl
from collections import deque
from urllib.parse import urlsplit

import orjson

from gateway.upstream.connection import ConnectError, ConnectTimeout, PoolError, ReadTimeout, ResponseClosed

# A turn's last event: its type comes first in OpenAI's events.
TERMINAL = re.compile(rb'"type"\s*:\s*"(?:response\.(?:completed|incomplete|failed)|error)"')
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455's, for the accept key
MAX_HEAD = 64 * 1024
MAX_MESSAGE = 64 * 1024 * 1024  # a bound on an upstream's message: past it the socket is dropped, the turn fails
OP_CONTINUATION, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
CLOSE_NORMAL = (1000).to_bytes(2, "big")
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
        if TERMINAL.search(message, 0, 96) is not None:
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
    """One WebSocket connection to an upstream `/responses` (RFC 6455, client side, no extensions)."""

    def __init__(self, idle_read_s: float | None, key: bytes) -> None:
        self.transport: asyncio.Transport | None = None
        self.idle_read_s = idle_read_s
        self.key = key  # the handshake's Sec-WebSocket-Key
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.buffer = b""  # bytes of a head or a frame not yet whole
        self.parts: list[bytes] = []  # a text message that arrives in several frames
        self.fragmented = 0  # the opcode of the message whose frames are arriving (0: none)
        self.turn: SocketTurn | None = None
        self.closed = False
        self.closing = False  # a close frame was sent
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
        authority = host if parts.port is None else f"{host}:{port}"
        key = base64.b64encode(os.urandom(16))
        head = [
            f"GET {target} HTTP/1.1\r\nhost: {authority}\r\n".encode(),
            b"upgrade: websocket\r\nconnection: Upgrade\r\nsec-websocket-version: 13\r\nsec-websocket-key: " + key,
            *(b"\r\n" + name + b": " + value for name, value in headers),
            b"\r\n\r\n",
        ]
        socket: UpstreamSocket | None = None
        try:
            async with asyncio.timeout(connect_timeout):
                _, socket = await loop.create_connection(
                    lambda: cls(idle_read_s, key), host, port, ssl=context if secure else None
                )
                socket._write(b"".join(head))
                await socket.opened
        except BaseException as exc:
            if socket is not None:
                socket.abort()  # timed out or cancelled half-way: nothing is left open
            if isinstance(exc, TimeoutError):
                raise ConnectTimeout(
                    f"the upstream WebSocket {url} was not open within {connect_timeout:g} s"
                ) from None
            if isinstance(exc, OSError):
                raise ConnectError(f"the upstream WebSocket {url}: {exc}") from None
            raise
        return socket

    # asyncio's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass of asyncio's

    def data_received(self, data: bytes) -> None:
        if self.buffer:
            data = self.buffer + data
            self.buffer = b""
        if not self.opened.done():
            data = self._head(data)
            if not data:
                return
        try:
            self.buffer = self._frames(data)
        except SocketClosed as exc:
            self._lost(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(SocketClosed(f"the upstream socket closed{f': {exc}' if exc else ''}"))

    def _head(self, data: bytes) -> bytes:
        """The handshake's answer: 101 with the right accept key opens the socket; anything else refuses it.
        Returns the bytes after the head (frames already sent)."""
        end = data.find(b"\r\n\r\n")
        if end < 0:
            if len(data) > MAX_HEAD:
                self._lost(SocketClosed("the upstream's answer to the upgrade has no end"))
            else:
                self.buffer = data
            return b""
        lines = data[:end].split(b"\r\n")
        status_line = lines[0].split(b" ", 2)
        status = int(status_line[1]) if len(status_line) > 1 and status_line[1].isdigit() else 0
        if status != 101:
            self.opened.set_exception(SocketRefused(status, data[end + 4 : end + 4 + 500]))
            self.opened.exception()  # as in _lost
            self.abort()
            return b""
        fields = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            fields[name.strip().lower()] = value.strip()
        expected = base64.b64encode(hashlib.sha1(self.key + GUID).digest())
        if fields.get(b"sec-websocket-accept") != expected or fields.get(b"upgrade", b"").lower() != b"websocket":
            self._lost(SocketClosed("the upstream's 101 is not a WebSocket upgrade (no matching accept key)"))
            return b""
        self.opened.set_result(None)
        return data[end + 4 :]

    def _frames(self, data: bytes) -> bytes:
        """Every whole frame in `data`, handled; returns what is left (a frame not yet whole)."""
        pos, size = 0, len(data)
        while size - pos >= 2:
            first, second = data[pos], data[pos + 1]
            length = second & 0x7F
            start = pos + 2
            if length == 126:
                if size - start < 2:
                    break
                length = int.from_bytes(data[start : start + 2], "big")
                start += 2
            elif length == 127:
                if size - start < 8:
                    break
                length = int.from_bytes(data[start : start + 8], "big")
                start += 8
            if second & 0x80:
                raise SocketClosed("the upstream masked a frame (servers must not)")
            if length > MAX_MESSAGE:
                raise SocketClosed(f"the upstream sent a frame of {length} bytes")
            if size - start < length:
                break
            pos = start + length
            self._frame(first, data[start:pos])
        return data[pos:]

    def _frame(self, first: int, payload: bytes) -> None:
        opcode = first & 0x0F
        final = first & 0x80
        if opcode == OP_TEXT and final and not self.fragmented:
            self._message(payload)  # the common case: one event, one frame
        elif opcode in (OP_TEXT, OP_BINARY, OP_CONTINUATION):
            if opcode != OP_CONTINUATION:
                self.fragmented = opcode
                self.parts.clear()
            self.parts.append(payload)
            if sum(map(len, self.parts)) > MAX_MESSAGE:
                raise SocketClosed("the upstream sent a message over the limit")
            if final:
                kind, self.fragmented = self.fragmented, 0
                if kind == OP_TEXT:
                    self._message(b"".join(self.parts))
                self.parts.clear()  # a binary message carries nothing for a turn
        elif opcode == OP_PING:
            self._write(frame(OP_PONG, payload))
        elif opcode == OP_CLOSE:
            code = int.from_bytes(payload[:2], "big") if len(payload) >= 2 else 1005
            if not self.closing:
                self.closing = True
                self._write(frame(OP_CLOSE, payload[:2]))
            raise SocketClosed(f"the upstream closed its socket ({code} {payload[2:200].decode('utf-8', 'replace')})")
        # A pong carries nothing.

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
            self.opened.exception()  # retrieved: whoever awaits it still gets it, no one else is told
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
        self._write(frame(OP_TEXT, body))
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
            if self.opened.done() and not self.closing:
                self.closing = True
                self._write(frame(OP_CLOSE, CLOSE_NORMAL))
            self._lost(SocketClosed("the upstream socket was closed by the gateway"))


def frame(opcode: int, payload: bytes) -> bytes:
    """One final frame from the client: masked, as RFC 6455 has a client's frames (a random key each)."""
    size = len(payload)
    if size < 126:
        head = bytes((0x80 | opcode, 0x80 | size))
    elif size < 1 << 16:
        head = bytes((0x80 | opcode, 0x80 | 126)) + size.to_bytes(2, "big")
    else:
        head = bytes((0x80 | opcode, 0x80 | 127)) + size.to_bytes(8, "big")
    key = os.urandom(4)
    if not size:
        return head + key
    # The XOR of the whole payload at once, as one big integer: no loop over bytes in Python.
    keys = (key * (size // 4 + 1))[:size]
    masked = (int.from_bytes(payload, "little") ^ int.from_bytes(keys, "little")).to_bytes(size, "little")
    return head + key + masked


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
