"""A request on a proxy route, answered by the pipeline straight onto the connection's transport.

uvicorn serves a request through its ASGI cycle: a scope dict with a copy of the app state, an asyncio.Event, a
task around the application, the app's path dispatch, and a response head checked with two regex searches a
header. For the proxy routes (`/v1/chat/completions` and the rest, the Azure forms) the protocol makes one of
these instead (server/protocol.py) and starts the pipeline on it: the head and body the parser gave, the time
the first byte arrived, and the two calls the pipeline makes, `receive()` for the body and a disconnect, and
`send()` with the two kinds of ASGI message, so that the pipeline, the relay and the Responses API speak one
language whichever server runs them.

What a client receives is what uvicorn's cycle would write, byte for byte (tests/unit/gateway/server): the
status line, uvicorn's default headers (`date`), the headers in order, `connection: close` when the client asked
for it, chunked framing when there is no content-length; `Expect: 100-continue` answered when the body is first
read; a head marked BODY_FOLLOWS leaves in one write with its body's first part. The common head (lower-case
names the process has checked before, no `connection` or `transfer-encoding`) costs a few C calls: the names
checked as a set, the values in one pass over the joined lines. Any other head takes the general path, which
does what uvicorn does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from operator import itemgetter

from starlette.types import Message
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from gateway.server.reply import BODY_FOLLOWS
from gateway.server.request import new_request_id

log = logging.getLogger("sluice.http")

# What uvicorn's HEADER_RE and HEADER_VALUE_RE refuse, as bytes to delete: a C pass over the bytes.
BAD_NAME = bytes([*range(0x20), 0x7F]) + b'()<>@,;:[]={} \t\\"'
BAD_VALUE = bytes([*range(0x09), *range(0x0A, 0x20), 0x7F])
# Header names sent before that are lower-case and valid, and none that the server must act on: each checked once.
NAMES: set[bytes] = set()
MAX_NAMES = 256  # the gateway's own are a few dozen; past this a new name is checked every time
CONTENT_LENGTH = b"content-length"
KNOWN: set[bytes] = {CONTENT_LENGTH}  # NAMES, and the one name the common head acts on
ACTED_ON = (b"connection", b"transfer-encoding", b"content-length")
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
DISCONNECT: Message = {"type": "http.disconnect"}
HIGH_WATER = 65536  # as uvicorn: past this much unread body, reading pauses
NAME = itemgetter(0)
PAIR = b": ".join
LAST_CHUNK = b"0\r\n\r\n"


def plain(name: bytes) -> bool:
    """A lower-case, valid header name that needs no handling (remembered in NAMES)."""
    if name in ACTED_ON or not name.islower() or len(name.translate(None, BAD_NAME)) != len(name):
        return False
    if len(NAMES) < MAX_NAMES:
        NAMES.add(name)
        KNOWN.add(name)
    return True


def checked_lines(pairs: Sequence[tuple[bytes, bytes]]) -> bytes:
    """`name: value` lines joined by CR LF, each value checked as uvicorn's regex does, in one C pass."""
    lines = b"\r\n".join(map(PAIR, pairs))
    # A value may hold no control character but tab: what the translation deletes beyond the CR LF between
    # the lines is one.
    if len(lines) - len(lines.translate(None, BAD_VALUE)) != 2 * max(len(pairs) - 1, 0):
        raise RuntimeError("Invalid HTTP header value.")
    return lines


def head_bytes(
    status: int, pairs: list[tuple[bytes, bytes]], keep_alive: bool, chunked: bool | None
) -> tuple[bytes, int | None, bool | None] | None:
    """The head uvicorn writes for `pairs` (its default headers first), where every name is lower-case, valid
    and none the server acts on but content-length: (the head, its content-length, whether the body is chunked).
    None: uvicorn's general path. The one framing of a head, for the direct cycle and the ASGI one (protocol.py).
    """
    names = [*map(NAME, pairs)]
    if KNOWN.issuperset(names):  # every name checked before, or content-length: a few C calls
        given = pairs[names.index(CONTENT_LENGTH)][1] if CONTENT_LENGTH in names else None
    else:
        given = None
        for name, value in pairs:
            if name in NAMES:
                continue
            if name == CONTENT_LENGTH:
                given = value if given is None else given  # the first one counts, as in uvicorn
            elif not plain(name):
                return None
    lines = checked_lines(pairs)  # uvicorn's regex, a C pass instead of two searches per header
    ending = b"\r\n" if pairs else b""
    length = None
    if given is not None:
        length = int(given.decode())
        chunked = False
    if not keep_alive:
        ending += b"connection: close\r\n"
    if chunked is None and status not in (204, 304):
        chunked = True
        ending += b"transfer-encoding: chunked\r\n"
    return STATUS_LINE[status] + lines + ending + b"\r\n", length, chunked


def body_bytes(body: bytes, more: bool) -> bytes:
    """A body part in chunked framing, with the last chunk after the body's last part."""
    out = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
    return out if more else out + LAST_CHUNK


class Direct:
    """One request of a connection on a proxy route, from its parsed head to its response's last byte."""

    # What most requests never change, as class attributes: only what differs is set on the instance.
    body = b""  # received and not yet taken
    more_body = True  # the parser has not seen the body's end
    ready = False  # something happened since the last receive(): body, its end, a disconnect
    waiter: asyncio.Future[None] | None = None
    gone: Callable[[], None] | None = None  # called once if the client leaves before the response is complete
    disconnected = False
    response_started = False
    response_complete = False
    head: bytes | None = None  # a head held for the body's first part
    chunked: bool | None = None
    length = 0  # content-length still to write

    def __init__(
        self,
        transport: asyncio.Transport,
        flow: FlowControl,
        headers: list[tuple[bytes, bytes]],
        arrived: float,
        default_headers: list[tuple[bytes, bytes]],
        request_id: bytes | None,
        encoding: bytes,
        keep_alive: bool,
        expect_100_continue: bool,
        on_response: Callable[[], None],
    ) -> None:
        self.transport = transport
        self.flow = flow
        self.headers = headers  # names lower-cased, in the order sent
        self.arrived = arrived  # perf_counter() when the request's first byte was read
        self.default_headers = default_headers
        # Noted by the protocol as the head was parsed: the client's own x-request-id (the first usable one, as
        # request.request_id takes it), and the body's content-encoding (lower-cased; b"": none).
        self.request_id = request_id.decode() if request_id is not None else new_request_id()
        self.encoding = encoding
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_100_continue
        self.on_response = on_response

    # Called by the protocol.
    def feed(self, data: bytes) -> None:
        self.body += data
        if len(self.body) > HIGH_WATER:
            self.flow.pause_reading()
        self.wake()

    def ended(self) -> None:
        self.more_body = False
        self.wake()

    @property
    def message_event(self) -> Direct:
        """What uvicorn's protocol sets when the connection is lost: this cycle, whose set() wakes its reader."""
        return self

    def set(self) -> None:
        """uvicorn's connection_lost, after it marked an unfinished response disconnected."""
        self.wake()
        gone = self.gone
        if self.disconnected and gone is not None:
            self.gone = None
            gone()

    def wake(self) -> None:
        self.ready = True
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # Called by the intake and the pipeline (server/responder.py: the direct cycle is a responder).
    def watch(self, gone: Callable[[], None]) -> None:
        self.gone = gone
        if self.disconnected:  # gone while the request was parsed
            gone()

    def unwatch(self) -> None:
        self.gone = None

    def whole(self) -> bytes | None:
        """The body, if all of it is here and nothing is owed first (a 100 Continue); else None: receive()."""
        if self.more_body or self.waiting_for_100_continue or self.disconnected:
            return None
        body, self.body = self.body, b""
        self.ready = False
        return body

    async def receive(self) -> Message:
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(CONTINUE)
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            self.flow.resume_reading()
            if not self.ready:
                waiter = self.waiter = asyncio.get_running_loop().create_future()
                await waiter
            self.ready = False
        if self.disconnected or self.response_complete:
            return DISCONNECT
        body, self.body = self.body, b""
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    async def send(self, message: Message) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        if not self.response_started:
            if message["type"] != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got '{message['type']}'.")
            self.response_started = True
            self.waiting_for_100_continue = False
            start = self._head(message["status"], message.get("headers", ()))
            if message.get(BODY_FOLLOWS):
                self.head = start
            else:
                self.transport.write(start)
            return
        if self.response_complete:
            raise RuntimeError(f"Unexpected ASGI message '{message['type']}' sent, after response already completed.")
        if message["type"] != "http.response.body":
            raise RuntimeError(f"Expected ASGI message 'http.response.body', but got '{message['type']}'.")
        body = message.get("body", b"")
        more = message.get("more_body", False)
        head, self.head = self.head, None
        if self.chunked:
            out = body_bytes(body, more)
        else:
            if len(body) > self.length:
                raise RuntimeError("Response content longer than Content-Length")
            self.length -= len(body)
            out = body
        if head is not None:
            out = head + out
        if out:
            self.transport.write(out)
        if not more:
            if self.length != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            self.wake()
            if not self.keep_alive:
                self.transport.close()
            self.on_response()

    async def answer(self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> None:
        """A whole response: what send() makes of a marked start and one last body part, in one call."""
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        if self.response_started:
            raise RuntimeError("Unexpected ASGI message 'http.response.start' sent, after response already started.")
        self.response_started = True
        self.waiting_for_100_continue = False
        head = self._head(status, headers)
        if self.chunked:
            out = head + body_bytes(body, False)
        elif len(body) != self.length:
            raise RuntimeError(
                f"Response content {'longer' if len(body) > self.length else 'shorter'} than Content-Length"
            )
        else:
            self.length = 0
            out = head + body
        self.transport.write(out)
        self.response_complete = True
        self.wake()
        if not self.keep_alive:
            self.transport.close()
        self.on_response()

    def _head(self, status: int, headers: Sequence[tuple[bytes, bytes]]) -> bytes:
        pairs = [*self.default_headers, *headers]
        framed = head_bytes(status, pairs, self.keep_alive, self.chunked)
        if framed is None:
            return self._general(status, pairs)  # a name not lower-case, or one the server must act on
        head, length, self.chunked = framed
        if length is not None:
            self.length = length
        return head

    def _general(self, status: int, pairs: list[tuple[bytes, bytes]]) -> bytes:
        """uvicorn's head for what the common path does not take: names lower-cased, each one checked, the
        headers a server acts on acted on."""
        content = [STATUS_LINE[status]]
        closing = False
        for raw, value in pairs:
            if len(raw.translate(None, BAD_NAME)) != len(raw):
                raise RuntimeError("Invalid HTTP header name.")
            if len(value.translate(None, BAD_VALUE)) != len(value):
                raise RuntimeError("Invalid HTTP header value.")
            name = raw.lower()
            if name == b"content-length" and self.chunked is None:
                self.length = int(value.decode())
                self.chunked = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.length = 0
                self.chunked = True
            elif name == b"connection" and b"close" in [token.lower().strip() for token in value.split(b",")]:
                self.keep_alive = False
                closing = True
            content.extend([name, b": ", value, b"\r\n"])
        if not self.keep_alive and not closing:
            content.append(b"connection: close\r\n")
        if self.chunked is None and status not in (204, 304):
            self.chunked = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        return b"".join(content)


Handler = Callable[[Direct], Awaitable[None]]
NOTHING: Callable[[], None] = lambda: None  # noqa: E731
INTERNAL = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"21"), (b"connection", b"close")]


async def failed(cycle: Direct, exc: BaseException) -> None:
    """The handler raised: a 500 if nothing was sent yet, else the connection is closed (as uvicorn's cycle)."""
    log.error("Exception in the request path", exc_info=exc)
    if not cycle.response_started:
        await cycle.send({"type": "http.response.start", "status": 500, "headers": INTERNAL})
        await cycle.send({"type": "http.response.body", "body": b"Internal Server Error", "more_body": False})
    else:
        cycle.transport.close()


async def unanswered(cycle: Direct) -> None:
    """The handler returned without a whole response: what it left is ended as uvicorn's cycle ends it."""
    if not cycle.response_started and not cycle.disconnected:
        log.error("the request path returned without starting a response")
        await cycle.send({"type": "http.response.start", "status": 500, "headers": INTERNAL})
        await cycle.send({"type": "http.response.body", "body": b"Internal Server Error", "more_body": False})
    elif not cycle.response_complete and not cycle.disconnected:
        log.error("the request path returned without completing its response")
        cycle.transport.close()
