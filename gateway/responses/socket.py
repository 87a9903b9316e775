"""One Responses API WebSocket: its turns, each an ordinary Responses request through the pipeline.

The intake reads the client's messages; each `response.create` is the HTTP create body (less `type`) and
becomes one request with every stage: auth and rate limits per turn, SLO fallback and failover before the
first event, a span, metrics and an access line that names the socket and the turn (`sluice.socket`,
`sluice.turn`). The responder (socket_responder.py) writes each event the pipeline sends as a JSON text message.

Turns run on lanes, as OpenAI's guide has them: creates with the same `stream_id` (or none) run one at a time
in the order they came, different lanes run at once; at most `max_in_flight` responses running or waiting on a
socket and `max_streams` named lanes, else `websocket_stream_limit_reached`. The socket keeps the last response
of each lane in memory: its full input and its output items. A turn whose `previous_response_id` names one of
them (on any lane: a new lane may fork a conversation) is sent upstream with that history expanded in front of
its new input, so continuing needs neither the backend's store nor the gateway's (it works with `store: false`,
and on backends that keep no responses: vLLM, llama.cpp, Ollama, TGI, the simulated one). Any other id is checked
like an HTTP create's (its owner must be the caller's tenant, else `previous_response_not_found`) and goes
upstream as it is.
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
from gateway.context import Target
from gateway.responses.index import Indexing
from gateway.responses.pinned import Pin, Pinned, Plan
from gateway.responses.socket_responder import Responder, error_event, tag
from gateway.server.websocket import SHUTDOWN
from gateway.wire.response_events import stream_events

if TYPE_CHECKING:
    from starlette.types import Message, Receive, Send

    from gateway.context import Exchange
    from gateway.responses.sockets import Sockets

log = logging.getLogger("sluice.websocket")

DROPPED = frozenset({"stream", "background", "type", "stream_id"})
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
Pending = tuple[str, dict[str, Any] | None]  # a message's text, and its parse when it was one JSON object


def as_items(given: Any) -> list[Any] | None:
    """A create's `input` as a list of items (a string is one user message); None for what is not an input,
    which request parsing refuses."""
    if given is None:
        return []
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    return list(given) if isinstance(given, list) else None


class Lane:
    """Creates with one `stream_id`: run in order by a task of their own while any wait."""

    __slots__ = ("last", "name", "queue", "task")

    def __init__(self, name: str | None) -> None:
        self.name = name
        self.queue: asyncio.Queue[Pending] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self.last: str | None = None  # the id of its last response, kept in the session's memory


class Session:
    """One client socket: reads its messages, runs its turns on their lanes, remembers each lane's last response."""

    def __init__(
        self, sockets: Sockets, headers: list[tuple[bytes, bytes]], tenant: str, ident: str, many: bool = False
    ) -> None:
        self.sockets = sockets
        self.many = many  # the server frames several messages in one write (gateway/server/websocket.py)
        self.settings = sockets.settings
        self.handshake = headers
        self.headers = [(k, v) for k, v in headers if k not in HANDSHAKE_ONLY]
        self.headers.append((b"content-type", b"application/json"))
        self.tenant = tenant
        self.ident = ident
        loop = asyncio.get_running_loop()
        self.opened = self.active = time.monotonic()
        self.turns = 0
        self.lanes: dict[str | None, Lane] = {}
        # Response id -> the conversation the gateway sent for it (input then output items), or None when the
        # chain is the backend's (the turn was sent with a previous_response_id the socket did not hold).
        self.kept: dict[str, list[Any] | None] = {}
        self.in_flight = 0  # responses running or waiting, on every lane
        self.changed = asyncio.Event()  # wakes the lifecycle loop
        self.gone = False
        self.stop: asyncio.Future[None] = loop.create_future()  # the client left, or its key was revoked
        self.revoked: errors.GatewayError | None = None
        self.draining = False
        self.send: Send | None = None
        # Upstream sockets pinned to this one, per backend (pinned.py), and its targets that use them.
        self.pins: dict[str, Pin] = {}
        self.pinned: dict[int, Target] = {}

    # The intake

    async def _read(self, receive: Receive) -> None:
        """Every client message onto its lane; the end of the socket, a shutdown, into the session's state."""
        try:
            while True:
                message = await receive()
                kind = message["type"]
                if kind == "websocket.receive":
                    self.active = time.monotonic()
                    await self._take(message.get("text"))
                elif kind == SHUTDOWN:
                    self.draining = True
                    self.changed.set()
                elif kind == "websocket.disconnect":
                    break
        finally:
            self.gone = True
            if not self.stop.done():
                self.stop.set_result(None)
            self.changed.set()

    async def _take(self, text: str | None) -> None:
        if text is None:
            await self.refuse(errors.BadRequestError("send events as JSON text messages, not binary"))
            return
        try:
            parsed = orjson.loads(text)
        except orjson.JSONDecodeError:
            parsed = None
        message = parsed if isinstance(parsed, dict) else None
        name = message.get("stream_id") if message is not None else None
        if name is not None and not isinstance(name, str):
            await self.refuse(errors.BadRequestError("'stream_id' must be a string", param="stream_id"))
            return
        if self.draining:
            await self.refuse(errors.ServiceUnavailableError("the gateway is shutting down", code="gateway_shutdown"))
            return
        if time.monotonic() - self.opened >= self.settings.max_lifetime_s:
            self.changed.set()  # the lifecycle loop says why and closes the socket once nothing runs
            return
        lane = self.lanes.get(name)
        if lane is None:
            if name is not None and len(self.lanes) - (None in self.lanes) >= self.settings.max_streams:
                await self.refuse(self._stream_limit(f"{self.settings.max_streams} named streams"), name)
                return
            lane = self.lanes[name] = Lane(name)
        if self.in_flight >= self.settings.max_in_flight:
            await self.refuse(self._stream_limit(f"{self.settings.max_in_flight} responses in flight"), name)
            return
        self.in_flight += 1
        lane.queue.put_nowait((text, message))
        if lane.task is None:
            lane.task = asyncio.get_running_loop().create_task(self._run_lane(lane))

    @staticmethod
    def _stream_limit(what: str) -> errors.GatewayError:
        return errors.BadRequestError(
            f"this socket already has {what}; wait for one to finish or open another socket",
            code="websocket_stream_limit_reached",
        )

    def _limit_error(self) -> errors.GatewayError:
        minutes = round(self.settings.max_lifetime_s / 60)
        return errors.BadRequestError(LIMIT_MESSAGE.format(minutes=minutes), code="websocket_connection_limit_reached")

    async def _disconnected(self) -> Message:
        """The pipeline's `receive` for a turn: answers only when the client has left or its key was revoked (the
        pipeline then stops the turn and its upstream request)."""
        await asyncio.shield(self.stop)
        return {"type": "http.disconnect"}

    def revoke(self, error: errors.GatewayError) -> None:
        """The key no longer authenticates: stop the running turns as if the client had left, then say why and close."""
        if self.revoked is None:
            self.revoked = error
            if not self.stop.done():
                self.stop.set_result(None)
            self.changed.set()

    # The lifecycle

    async def run(self, receive: Receive, send: Send) -> None:
        self.send = send
        reader = asyncio.get_running_loop().create_task(self._read(receive))
        settings = self.settings
        try:
            while not self.gone:
                now = time.monotonic()
                if self.in_flight == 0:
                    if self.revoked is not None:
                        await self.refuse(self.revoked)
                        await self._close(CLOSE_POLICY, "the key was revoked")
                        return
                    if self.draining:
                        await self._close(CLOSE_GOING_AWAY, "server shutting down")
                        return
                    if now - self.opened >= settings.max_lifetime_s:
                        await self.refuse(self._limit_error())
                        await self._close(CLOSE_NORMAL, "connection limit reached")
                        return
                    if now - self.active >= settings.idle_timeout_s:
                        await self._close(CLOSE_NORMAL, "idle timeout")
                        return
                    wait: float | None = (
                        min(self.active + settings.idle_timeout_s, self.opened + settings.max_lifetime_s) - now
                    )
                else:
                    wait = None  # a turn runs: its end wakes this loop
                self.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), wait)
        finally:
            tasks = [lane.task for lane in self.lanes.values() if lane.task is not None]
            for task in tasks:
                task.cancel()
            reader.cancel()
            for task in (*tasks, reader):
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _close(self, code: int, reason: str) -> None:
        if self.gone or self.send is None:
            return
        with contextlib.suppress(Exception):
            await self.send({"type": "websocket.close", "code": code, "reason": reason})

    async def refuse(self, error: errors.GatewayError, lane: str | None = None) -> None:
        if self.gone or self.send is None:
            return
        with contextlib.suppress(Exception):
            await self.send({"type": "websocket.send", "text": error_event(error, lane)})

    # A lane's turns

    async def _run_lane(self, lane: Lane) -> None:
        try:
            while not lane.queue.empty():
                text, message = lane.queue.get_nowait()
                try:
                    if self.draining:  # waiting when the shutdown began: not started, said so
                        error = errors.ServiceUnavailableError("the gateway is shutting down", code="gateway_shutdown")
                        await self.refuse(error, lane.name)
                    elif not (self.gone or self.revoked):
                        await self._turn(lane, text, message)
                except Exception:
                    # A bug must cost one turn, never the socket: the client gets an error event, the log the trace.
                    log.exception("websocket %s: turn %d failed inside the gateway", self.ident, self.turns)
                    await self.refuse(errors.GatewayError("internal gateway error", code="internal_error"), lane.name)
                finally:
                    self.in_flight -= 1
                    self.active = time.monotonic()
                    self.changed.set()
        finally:
            lane.task = None

    async def _turn(self, lane: Lane, text: str, message: dict[str, Any] | None) -> None:
        self.turns += 1
        turn = self.turns
        started = time.perf_counter()
        try:
            body = self._body(text, message)
        except errors.GatewayError as exc:
            await self.sockets.refused(self, exc, lane.name, turn, started)
            return
        if body is None:
            return
        items: list[Any] | None = None
        plan: Plan | None = None
        previous = body.get("previous_response_id")
        given = as_items(body.get("input"))
        held = self.kept.get(previous) if isinstance(previous, str) else None
        if held is not None and given is not None:
            if self.sockets.dialers:  # a pinned upstream socket that made `previous` is sent the create as it came
                assert isinstance(previous, str)
                plan = (dict(body), previous)
            items = held + given
            body["input"] = items
            del body["previous_response_id"]  # expanded here: the upstream needs no stored chain
        elif previous is None:
            items = given
        if body.get("generate") is False:
            await self._warm(lane, body, items)
            self.sockets.warmed(self, body, lane.name, turn, started)
            return
        sent = self.send
        assert sent is not None
        responder = Responder(sent, self._disconnected, lane.name, self.many)
        await self.sockets.run(self, body, started, responder, turn, plan)
        response = responder.response
        if responder.failed or response is None or not isinstance(response.get("id"), str):
            return
        if items is not None:
            output = response.get("output")
            items = items + (output if isinstance(output, list) else [])
        self._keep(lane, response["id"], items)

    def pin(self, ex: Exchange, plan: Plan | None) -> None:
        """The turn's targets on backends with the WebSocket mode become this socket's, which use its pinned
        upstream sockets (the others are left as they are)."""
        targets = ex.targets
        for i, target in enumerate(targets):
            pinned = self.pinned.get(id(target))
            if pinned is None:
                provider = target.provider
                if target.backend not in self.sockets.dialers or not isinstance(provider, Indexing):
                    continue
                wrapped: Any = Pinned(provider, self.pin_for(target.backend))  # a Provider, as Indexing is
                pinned = Target(target.model, target.backend, target.upstream_model, target.settings, wrapped)
                self.pinned[id(target)] = pinned
            targets[i] = pinned
            if plan is not None:
                self.pins[target.backend].plans[ex.request_id] = plan

    def pin_for(self, backend: str) -> Pin:
        pin = self.pins.get(backend)
        if pin is None:
            pin = self.pins[backend] = Pin(self.sockets.dialers[backend], self.handshake, self.ident)
        return pin

    def unplan(self, rid: str) -> None:
        for pin in self.pins.values():
            pin.plans.pop(rid, None)

    def unpin(self) -> None:
        """The client socket is closing: so do its upstream sockets (and any still opening)."""
        for pin in self.pins.values():
            pin.close()

    def _keep(self, lane: Lane, ident: str, items: list[Any] | None) -> None:
        """The lane's last response replaces its previous one in the socket's memory."""
        if lane.last is not None:
            self.kept.pop(lane.last, None)
        lane.last = ident
        self.kept[ident] = items

    def _body(self, text: str, message: dict[str, Any] | None) -> dict[str, Any] | None:
        """The create body of a client message, or None for a message that asks for nothing."""
        if message is None:
            try:
                orjson.loads(text)
            except orjson.JSONDecodeError as exc:
                raise errors.BadRequestError(f"the message is not valid JSON: {exc}") from None
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
        body = {key: value for key, value in message.items() if key not in DROPPED}
        body["stream"] = True  # every answer on a socket is its event stream
        return body

    async def _warm(self, lane: Lane, body: dict[str, Any], items: list[Any] | None) -> None:
        """`generate: false`: a response with no output that later turns can continue, made here."""
        now = int(time.time())
        ident = "resp_" + secrets.token_hex(24)
        response = {
            "id": ident,
            "object": "response",
            "created_at": now,
            "status": "completed",
            "completed_at": now,
            "error": None,
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "model": body.get("model"),
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
        prefix = tag(lane.name)
        for group in stream_events(response):
            for event in group:
                payload = orjson.dumps(event)
                if prefix:
                    payload = b"{" + prefix + payload[1:]
                await send({"type": "websocket.send", "text": payload.decode()})
        self._keep(lane, ident, items)
