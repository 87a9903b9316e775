"""The responder of a turn on a Responses API WebSocket: what the pipeline sends, as the socket's messages.

The pipeline answers a turn as it answers an HTTP request (ASGI's start and body messages). A stream is split
into its SSE events and each event's `data` goes out as one text message, as it came (only a terminal event is
parsed, to keep the response for the socket's memory). An error answer (a 4xx from a plugin, the admission step
or an upstream, or the gateway's error event at the end of a broken stream) becomes OpenAI's error event,
`{"type": "error", "status": S, "error": {...}}`, with `retry-after` under `headers`. On a named lane
(`stream_id`) every event echoes it.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import orjson

from gateway import errors
from gateway.server.responder import Watcher
from gateway.server.websocket import SEND_MANY
from gateway.wire.response_events import TERMINAL

if TYPE_CHECKING:
    from collections.abc import Sequence

    from starlette.types import Message, Receive, Send

    from gateway import errors

TERMINAL_BYTES = tuple(kind.encode() for kind in TERMINAL.values())


def error_event(error: errors.GatewayError, lane: str | None = None) -> str:
    """OpenAI's error event on a socket: the HTTP status and the API's error object (and the lane's `stream_id`)."""
    event: dict[str, Any] = {"type": "error", "status": error.status, **error.payload()}
    if error.headers:
        event["headers"] = {name.decode("latin-1"): value.decode("latin-1") for name, value in error.headers}
    if lane is not None:
        event["stream_id"] = lane
    return orjson.dumps(event).decode()


def tag(lane: str | None) -> bytes:
    """What goes after an event's opening brace on a lane: its `stream_id` member."""
    return b"" if lane is None else b'"stream_id":' + orjson.dumps(lane) + b","


class Responder(Watcher):
    """The pipeline's responder for one turn: SSE events out as text messages, an error answer as an error event;
    a disconnect learnt from the turn's `receive` (the socket closed, or its key revoked)."""

    def __init__(self, out: Send, receive: Receive, lane: str | None = None, many: bool = False) -> None:
        super().__init__(receive)
        self.out = out
        self.many = many  # the server takes several messages at once (gateway/server/websocket.py)
        self.lane = lane
        self.tag = tag(lane)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.pending = b""
        self.error_body = b""
        self.response: dict[str, Any] | None = None  # the terminal event's response
        self.failed = False  # an error went out: no response to remember
        self.events = 0

    async def answer(self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> None:
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", ()))
            return
        body: bytes = message.get("body", b"")
        if self.status != 200:
            self.error_body += body
            if not message.get("more_body", False):
                await self._error_answer()
            return
        data = self.pending + body if self.pending else body
        end = data.rfind(b"\n\n")
        if end < 0:
            self.pending = data
            return
        self.pending = data[end + 2 :]
        texts = [text for block in data[:end].split(b"\n\n") if (text := self._event(block)) is not None]
        if not texts:
            return
        if self.many and len(texts) > 1:
            await self.out({"type": SEND_MANY, "texts": texts})  # the events of one upstream read, one write
        else:
            for text in texts:
                await self.out({"type": "websocket.send", "text": text})

    def _event(self, block: bytes) -> str | None:
        """The message for one SSE event, or None for none (a comment, `[DONE]`)."""
        name = b""
        payload = b""
        for line in block.split(b"\n"):
            if line.startswith(b"data:"):
                part = line[5:].lstrip(b" ")
                payload = payload + b"\n" + part if payload else part
            elif line.startswith(b"event:"):
                name = line[6:].strip()
        if not payload or payload == b"[DONE]":
            return None
        if payload.startswith(b'{"error"'):  # the gateway's own end of a broken stream (errors.sse_event)
            try:
                found = orjson.loads(payload).get("error") or {}
            except orjson.JSONDecodeError:
                found = {}
            return self._error(_status_of(found), found)
        if name in TERMINAL_BYTES or (not name and any(kind in payload[:80] for kind in TERMINAL_BYTES)):
            with contextlib.suppress(orjson.JSONDecodeError):
                event = orjson.loads(payload)
                if isinstance(event, dict) and isinstance(event.get("response"), dict):
                    self.response = event["response"]
        elif name == b"error":
            self.failed = True
        self.events += 1
        if self.tag and payload.startswith(b"{"):
            payload = b"{" + self.tag + payload[1:]
        return payload.decode()

    async def _error_answer(self) -> None:
        try:
            found = orjson.loads(self.error_body).get("error")
        except (orjson.JSONDecodeError, AttributeError):
            found = None
        if not isinstance(found, dict):
            found = {"message": self.error_body.decode("utf-8", "replace")[:500], "type": "server_error"}
        await self.out({"type": "websocket.send", "text": self._error(self.status, found, self.headers)})

    def _error(self, status: int, error: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None) -> str:
        self.failed = True
        event: dict[str, Any] = {"type": "error", "status": status, "error": error}
        kept = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers or () if k in (b"retry-after",)}
        if kept:
            event["headers"] = kept
        if self.lane is not None:
            event["stream_id"] = self.lane
        return orjson.dumps(event).decode()


# A broken stream's last event carries the error but not the status a whole answer would have had: told by
# its code (a cut upstream 502, an upstream past its deadline 504, the gateway going away 503), else 500.
BROKEN_STATUS: dict[object, int] = {
    errors.UpstreamError.code: errors.UpstreamError.status,
    errors.UpstreamTimeoutError.code: errors.UpstreamTimeoutError.status,
    errors.ServiceUnavailableError.code: errors.ServiceUnavailableError.status,
}


def _status_of(error: dict[str, Any]) -> int:
    status = BROKEN_STATUS.get(error.get("code"))
    if status is not None:
        return status
    return errors.UpstreamError.status if error.get("type") == "upstream_error" else 500
