"""One Responses API WebSocket: its turns, each an ordinary Responses request through the pipeline.

The intake reads the client's messages; each `response.create` is the HTTP create body (less `type`) and
becomes one request with every stage: auth and rate limits per turn, SLO fallback and failover before the
first event, a span, metrics and an access line that names the socket and the turn (`sluice.socket`,
`sluice.turn`). The responder takes what the pipeline sends (a Responses SSE stream, or an error answer)
and writes each event as one JSON text message, as OpenAI's WebSocket mode does.

Turns run one at a time, in the order they came; more than `max_queued` waiting get an error event each.
The connection keeps its last response in memory: its full input and its output items. A turn whose
`previous_response_id` names it is sent upstream with that history expanded in front of its new input, so
continuing needs neither the backend's store nor the gateway's (it works with `store: false`, and on
backends that keep no responses: vLLM, llama.cpp, Ollama, TGI, the simulated one). Any other id is
checked like an HTTP create's (its owner must be the caller's tenant, else `previous_response_not_found`)
and goes upstream as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

import orjson

from gateway import errors
from gateway.server import request
from gateway.server.websocket import SHUTDOWN
from gateway.wire.response_events import TERMINAL, stream_events

if TYPE_CHECKING:
    from starlette.types import Message, Receive, Send

    from gateway.responses.sockets import Sockets

log = logging.getLogger("sluice.websocket")

TERMINAL_TYPES = frozenset(TERMINAL.values())
TERMINAL_BYTES = tuple(kind.encode() for kind in TERMINAL_TYPES)
DROPPED = frozenset({"stream", "background", "type"})
# Headers of the handshake that describe the upgrade, not the requests made over it.
HANDSHAKE_ONLY = frozenset(
    {
        b"upgrade",
        b"connection",
        b"sec-websocket-key",
        b"sec-websocket-version",
        b"sec-websocket-extensions",
        b"sec-websocket-protocol",
        b"content-length",
        b"transfer-encoding",
        b"x-request-id",
    }
)
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY = 1008
LIMIT_MESSAGE = (
    "Responses websocket connection limit reached ({minutes} minutes). Create a new websocket connection to continue."
)


def error_event(error: errors.GatewayError) -> str:
    """OpenAI's error event on a socket: the HTTP status and the API's error object."""
    event: dict[str, Any] = {"type": "error", "status": error.status, **error.payload()}
    if error.headers:
        event["headers"] = {name.decode("latin-1"): value.decode("latin-1") for name, value in error.headers}
    return orjson.dumps(event).decode()


def as_items(given: Any) -> list[Any] | None:
    """A create's `input` as a list of items (a string is one user message); None for what is not an input,
    which request parsing refuses."""
    if given is None:
        return []
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    return list(given) if isinstance(given, list) else None


class Last:
    """The connection's last response: its id and, when the gateway made its input, the whole conversation."""

    __slots__ = ("ident", "items")

    def __init__(self, ident: str, items: list[Any] | None) -> None:
        self.ident = ident
        self.items = items  # input then output items; None: the chain is the backend's (sent with the id)


class Responder:
    """The pipeline's `send` for one turn: SSE events out as text messages, an error answer as an error event."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.pending = b""
        self.error_body = b""
        self.response: dict[str, Any] | None = None  # the terminal event's response
        self.failed = False  # an error went out: no response to remember
        self.events = 0

    async def __call__(self, message: Message) -> None:
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
        for block in data[:end].split(b"\n\n"):
            await self._event(block)

    async def _event(self, block: bytes) -> None:
        name = b""
        payload = b""
        for line in block.split(b"\n"):
            if line.startswith(b"data:"):
                part = line[5:].lstrip(b" ")
                payload = payload + b"\n" + part if payload else part
            elif line.startswith(b"event:"):
                name = line[6:].strip()
        if not payload or payload == b"[DONE]":
            return
        if payload.startswith(b'{"error"'):  # the gateway's own end of a broken stream (errors.sse_event)
            try:
                found = orjson.loads(payload).get("error") or {}
            except orjson.JSONDecodeError:
                found = {}
            await self._send_error(500, found)
            return
        if name in TERMINAL_BYTES or (not name and any(kind in payload[:80] for kind in TERMINAL_BYTES)):
            with contextlib.suppress(orjson.JSONDecodeError):
                event = orjson.loads(payload)
                if isinstance(event, dict) and isinstance(event.get("response"), dict):
                    self.response = event["response"]
        elif name == b"error":
            self.failed = True
        self.events += 1
        await self.send({"type": "websocket.send", "text": payload.decode()})

    async def _error_answer(self) -> None:
        try:
            found = orjson.loads(self.error_body).get("error")
        except (orjson.JSONDecodeError, AttributeError):
            found = None
        if not isinstance(found, dict):
            found = {"message": self.error_body.decode("utf-8", "replace")[:500], "type": "server_error"}
        await self._send_error(self.status, found, self.headers)

    async def _send_error(
        self, status: int, error: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        self.failed = True
        event: dict[str, Any] = {"type": "error", "status": status, "error": error}
        kept = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers or () if k in (b"retry-after",)}
        if kept:
            event["headers"] = kept
        await self.send({"type": "websocket.send", "text": orjson.dumps(event).decode()})


class Session:
    """One client socket: reads its messages, runs its turns in order, keeps its last response."""

    def __init__(self, sockets: Sockets, headers: list[tuple[bytes, bytes]], tenant: str, ident: str) -> None:
        self.sockets = sockets
        self.settings = sockets.settings
        self.handshake = headers
        self.headers = [(k, v) for k, v in headers if k not in HANDSHAKE_ONLY]
        self.headers.append((b"content-type", b"application/json"))
        self.tenant = tenant
        self.ident = ident
        self.opened = time.monotonic()
        self.turns = 0
        self.last: Last | None = None
        self.inbox: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self.gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.stop: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # the client left, or its key went
        self.revoked: errors.GatewayError | None = None
        self.draining = False
        self.running = False
        self.send: Send | None = None
        self.close_code: int | None = None

    # The intake

    async def _read(self, receive: Receive) -> None:
        """Every client message into the inbox, in order; the end of the socket into `gone`."""
        try:
            while True:
                message = await receive()
                kind = message["type"]
                if kind == "websocket.receive":
                    text = message.get("text")
                    if text is None:
                        await self._refuse(errors.BadRequestError("send events as JSON text messages, not binary"))
                        continue
                    if self.inbox.qsize() >= self.settings.max_queued:
                        await self._refuse(
                            errors.RateLimitError(
                                f"more than {self.settings.max_queued} response.create events are waiting on this "
                                "socket; wait for response.completed before sending the next",
                                code="websocket_queue_full",
                            )
                        )
                        continue
                    self.inbox.put_nowait(("message", text))
                elif kind == SHUTDOWN:
                    self.draining = True
                    self.inbox.put_nowait(("shutdown", ""))
                elif kind == "websocket.disconnect":
                    self.close_code = message.get("code")
                    break
        finally:
            if not self.gone.done():
                self.gone.set_result(None)
            if not self.stop.done():
                self.stop.set_result(None)
            self.inbox.put_nowait(("gone", ""))

    def revoke(self, error: errors.GatewayError) -> None:
        """The key no longer authenticates: stop the running turn as if the client had left, then say why and close."""
        if self.revoked is None:
            self.revoked = error
            if not self.stop.done():
                self.stop.set_result(None)
            self.inbox.put_nowait(("revoked", ""))

    async def _disconnected(self) -> Message:
        """The pipeline's `receive` for a turn: answers only when the client has left or its key was revoked (the
        pipeline then stops the turn and its upstream request)."""
        await asyncio.shield(self.stop)
        return {"type": "http.disconnect"}

    # The loop

    async def run(self, receive: Receive, send: Send) -> None:
        self.send = send
        reader = asyncio.get_running_loop().create_task(self._read(receive))
        settings = self.settings
        try:
            while not self.gone.done():
                left = self.opened + settings.max_lifetime_s - time.monotonic()
                try:
                    kind, text = await asyncio.wait_for(self.inbox.get(), min(settings.idle_timeout_s, max(left, 0)))
                except TimeoutError:
                    if left <= settings.idle_timeout_s:
                        await self._lifetime_over()
                    else:
                        await self._close(CLOSE_NORMAL, "idle timeout")
                    return
                if kind == "gone":
                    return
                if self.revoked is not None:
                    await self._close_revoked()
                    return
                if kind == "shutdown" or self.draining:
                    await self._close(CLOSE_GOING_AWAY, "server shutting down")
                    return
                if time.monotonic() - self.opened >= settings.max_lifetime_s:
                    await self._lifetime_over()
                    return
                self.running = True
                try:
                    await self._turn(text)
                except Exception:
                    # A bug must cost one turn, never the socket: the client gets an error event, the log the trace.
                    log.exception("websocket %s: turn %d failed inside the gateway", self.ident, self.turns)
                    await self._refuse(errors.GatewayError("internal gateway error", code="internal_error"))
                finally:
                    self.running = False
                if self.revoked is not None:
                    await self._close_revoked()
                    return
                if self.draining and not self.gone.done():
                    await self._close(CLOSE_GOING_AWAY, "server shutting down")
                    return
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _close_revoked(self) -> None:
        assert self.revoked is not None
        await self._refuse(self.revoked)
        await self._close(CLOSE_POLICY, "the key was revoked")

    async def _lifetime_over(self) -> None:
        minutes = round(self.settings.max_lifetime_s / 60)
        error = errors.BadRequestError(LIMIT_MESSAGE.format(minutes=minutes), code="websocket_connection_limit_reached")
        await self._refuse(error)
        await self._close(CLOSE_NORMAL, "connection limit reached")

    async def _close(self, code: int, reason: str) -> None:
        if self.gone.done() or self.send is None:
            return
        with contextlib.suppress(Exception):
            await self.send({"type": "websocket.close", "code": code, "reason": reason})

    async def _refuse(self, error: errors.GatewayError) -> None:
        if self.gone.done() or self.send is None:
            return
        with contextlib.suppress(Exception):
            await self.send({"type": "websocket.send", "text": error_event(error)})

    # A turn

    async def _turn(self, text: str) -> None:
        self.turns += 1
        started = time.perf_counter()
        try:
            body = self._body(text)
        except errors.GatewayError as exc:
            await self._refuse(exc)
            return
        if body is None:
            return
        items: list[Any] | None = None
        previous = body.get("previous_response_id")
        last = self.last
        given = as_items(body.get("input"))
        if previous is not None and last is not None and previous == last.ident and last.items is not None:
            if given is not None:
                items = last.items + given
                body["input"] = items
                del body["previous_response_id"]  # expanded here: the upstream needs no stored chain
        elif previous is None:
            items = given
        if body.get("generate") is False:
            await self._warm(body, items)
            return
        sent = self.send
        assert sent is not None
        responder = Responder(sent)
        rid = request.new_request_id()
        await self.sockets.run(self, body, started, rid, self._disconnected, responder)
        response = responder.response
        if responder.failed or response is None or not isinstance(response.get("id"), str):
            return
        if items is not None:
            output = response.get("output")
            items = items + (output if isinstance(output, list) else [])
        self.last = Last(response["id"], items)

    def _body(self, text: str) -> dict[str, Any] | None:
        """The create body of a client message, or None for a message that asks for nothing."""
        try:
            message = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise errors.BadRequestError(f"the message is not valid JSON: {exc}") from None
        if not isinstance(message, dict):
            raise errors.BadRequestError("a message must be a JSON object with a 'type'")
        kind = message.get("type")
        if kind == "response.processed":
            return None  # a client's acknowledgement (Codex sends one): nothing to answer
        if kind != "response.create":
            raise errors.BadRequestError(
                f"unsupported event type {kind!r}: this socket takes 'response.create'",
                param="type",
                code="unsupported_event_type",
            )
        if message.get("background"):
            raise errors.BadRequestError("background is not supported over WebSocket", param="background")
        if message.get("stream_id") is not None:
            raise errors.BadRequestError(
                "stream_id (several responses in flight on one socket) is not supported by this gateway: "
                "open one socket per conversation",
                param="stream_id",
                code="unsupported_parameter",
            )
        body = {key: value for key, value in message.items() if key not in DROPPED}
        body.pop("stream_id", None)
        body["stream"] = True  # every answer on a socket is its event stream
        return body

    async def _warm(self, body: dict[str, Any], items: list[Any] | None) -> None:
        """`generate: false`: a response with no output that later turns can continue, made here."""
        now = int(time.time())
        ident = "resp_" + secrets.token_hex(24)
        model = body.get("model")
        response = {
            "id": ident,
            "object": "response",
            "created_at": now,
            "status": "completed",
            "completed_at": now,
            "error": None,
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "model": model,
            "output": [],
            "previous_response_id": body.get("previous_response_id"),
            "store": body.get("store", True),
            "tools": body.get("tools") or [],
            "usage": {
                "input_tokens": 0,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": 0,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": 0,
            },
        }
        send = self.send
        assert send is not None
        for group in stream_events(response):
            for event in group:
                await send({"type": "websocket.send", "text": orjson.dumps(event).decode()})
        self.last = Last(ident, items)

    # For the front door

    def tagged(self, ex: Any) -> None:
        """What the turn's span and access line say of its socket."""
        ex.attributes["sluice.transport"] = "websocket"
        ex.attributes["sluice.socket"] = self.ident
        ex.attributes["sluice.turn"] = self.turns
