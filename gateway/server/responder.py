"""The responder: how the pipeline answers a request, whatever front door it came through.

Three things, and nothing about the transport beyond them: send a message (ASGI's `http.response.start`,
marked BODY_FOLLOWS when its body follows at once, and `http.response.body`), answer whole (the head and the
body in one call), and learn of a disconnect (`watch` a callback, `unwatch` it once the response is over).

The protocol's direct cycle (server/direct.py) is one: it writes onto the connection's transport and hears of
a lost connection from the protocol. `Asgi` below is the other, for every request that came through an ASGI
server. A front door that answers in another shape wraps one of these: Anthropic's errors
(gateway/messages/api.py), a WebSocket turn's messages (gateway/responses/socket_responder.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from mypy_extensions import mypyc_attr

from gateway.server.reply import BODY_FOLLOWS

if TYPE_CHECKING:
    from starlette.types import Message, Receive, Send

# Under ASGI a disconnect is reported only through receive(): a watcher on it starts once a request has lasted
# this long. Most non-stream answers are done by then, and a client gone sooner loses nothing but these
# milliseconds of upstream work; a watcher from the start would cost every request a task.
WATCH_AFTER_S = 0.05


class Responder(Protocol):
    """What the pipeline answers through (see the module's docstring)."""

    def send(self, message: Message, /) -> Awaitable[None]: ...

    async def answer(self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> None: ...

    def watch(self, gone: Callable[[], None]) -> None:
        """Call `gone` once if the client leaves before `unwatch`; at once if it has left already."""

    def unwatch(self) -> None: ...


@mypyc_attr(allow_interpreted_subclasses=True)  # the WebSocket turn's responder (responses/socket_responder.py)
class Watcher:
    """A disconnect learnt from an ASGI `receive`: a read of it started WATCH_AFTER_S into the request."""

    __slots__ = ("gone", "reading", "receive", "timer")

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.gone: Callable[[], None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.reading: asyncio.Future[Any] | None = None

    def watch(self, gone: Callable[[], None]) -> None:
        self.gone = gone
        self.timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, self._read)

    def _read(self) -> None:
        self.timer = None
        if self.gone is not None:
            self.reading = asyncio.ensure_future(self.receive())
            self.reading.add_done_callback(self._left)

    def _left(self, _: object) -> None:
        gone, self.gone = self.gone, None
        if gone is not None:
            gone()

    def unwatch(self) -> None:
        self.gone = None  # first: cancelling the read below runs _left, which must then do nothing
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.reading is not None:
            self.reading.cancel()
            self.reading = None


class Asgi(Watcher):
    """The responder of a request that came through ASGI: its `send`, and its `receive` for a disconnect."""

    __slots__ = ("send",)

    def __init__(self, receive: Receive, send: Send) -> None:
        super().__init__(receive)
        self.send = send  # the ASGI callable itself: no frame of ours in between

    async def answer(self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> None:
        await self.send({"type": "http.response.start", "status": status, "headers": headers, BODY_FOLLOWS: True})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})
