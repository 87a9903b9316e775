"""The Responses API's WebSocket mode: the handshake on `GET /v1/responses`, the caps, the open sockets.

A client (Codex with `openai_base_url`, the `openai` SDK's `responses.connect()`) opens a WebSocket on the
path it would POST to and sends a `response.create` event per turn (gateway/responses/socket.py runs them).
The handshake is judged before the upgrade is accepted, so that a client that should stop gets a plain HTTP
answer it understands instead of a socket that closes at once (which clients retry):
- the key, from `Authorization: Bearer` or `api-key`, by the `auth` plugin as for any request: 401 or 403;
- the caps on open sockets, per process (`max_connections`) and per tenant (`max_per_tenant`): 429 with
  `retry-after` (a client may retry later, or fall back to HTTP);
- the mode switched off (`responses.websocket.enabled: false`), or another path: 404.
Headers OpenAI's clients send (`OpenAI-Beta: responses_websockets=...`, `session_id`, `originator`) are
accepted and change nothing. The upgrade's answer carries `x-request-id` (the socket's id, in every turn's
access line as `sluice.socket`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import orjson

from gateway import errors
from gateway.context import Exchange
from gateway.response import Reply
from gateway.responses.pinned import dialers
from gateway.responses.socket import Session
from gateway.server import request
from gateway.server.reply import JSON
from gateway.server.websocket import SEND_MANY
from gateway.telemetry.access import refusal_line

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from gateway.pipeline import Pipeline
    from gateway.responses.pinned import Plan
    from gateway.responses.socket_responder import Responder
    from gateway.server.intake import Intake
    from gateway.settings import Settings
    from gateway.telemetry.metrics import Meter

log = logging.getLogger("sluice.websocket")

PATHS = frozenset({"/v1/responses", "/responses", "/openai/v1/responses"})
HANDSHAKE = "websocket"  # the handshake's Exchange has this resource: it names no model to check
RETRY_AFTER = (b"retry-after", b"1")
SWEEP_S = 1.0  # how often the open sockets' keys are checked again


async def deny(send: Send, error: errors.GatewayError, rid: str) -> None:
    """Refuse an upgrade with a plain HTTP answer (ASGI's WebSocket denial response) in OpenAI's error format."""
    body = error.body()
    headers = [JSON, (b"content-length", str(len(body)).encode()), (b"x-request-id", rid.encode()), *error.headers]
    await send({"type": "websocket.http.response.start", "status": error.status, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": body, "more_body": False})


class Sockets:
    """The open sockets of this process, and how a turn becomes a request through the pipeline."""

    def __init__(self, settings: Settings, pipeline: Pipeline, intake: Intake, meter: Meter | None = None) -> None:
        self.settings = settings.responses.websocket
        self.pipeline = pipeline
        self.intake = intake
        # The auth plugin's hook, if it is configured: the handshake runs it alone (a turn runs every stage).
        self.auth = next((hook for name, hook in pipeline.on_request if name == "auth"), None)
        self.open: set[Session] = set()
        self.per_tenant: dict[str, int] = {}
        self.turns = 0  # turns run by this process, for tests and the status page
        self.sweeper: asyncio.Task[None] | None = None  # checks the open sockets' keys while there are any
        self.accepted = 0
        # OpenAI and Azure backends with the WebSocket mode upstream: a client socket's turns there take a socket
        # of their own (pinned.py).
        self.dialers = dialers(settings, pipeline.upstreams)
        self.gauge = self.counter = None
        if meter is not None:
            self.gauge = meter.gauge(
                "sluice_websocket_connections", "Responses API WebSocket connections open.", ("tenant",)
            )
            self.counter = meter.counter(
                "sluice_websocket_turns_total", "response.create turns run over the Responses WebSocket.", ("tenant",)
            )
            self.tenant_label = meter.tenant

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A WebSocket on a Responses path: judged, then served until either side closes it."""
        started = time.perf_counter()
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        rid = request.request_id(headers)
        what = f"GET {scope['path']} (websocket)"
        if not self.settings.enabled:
            await self._refuse(send, errors.NotFoundError("unknown URL", code="unknown_url"), rid, what, started)
            return
        try:
            tenant = await self._authenticate(headers, rid, started)
            self._admit(tenant)
        except errors.GatewayError as exc:
            await self._refuse(send, exc, rid, what, started)
            return
        session = Session(self, headers, tenant, rid, SEND_MANY in scope.get("extensions", {}))
        self.open.add(session)
        self.per_tenant[tenant] = self.per_tenant.get(tenant, 0) + 1
        label = self.tenant_label(tenant) if self.gauge is not None else ""
        if self.gauge is not None:
            self.gauge.labels(label).inc()
        self.accepted += 1
        if self.auth is not None and self.sweeper is None:
            self.sweeper = asyncio.get_running_loop().create_task(self._sweep())
        try:
            await send({"type": "websocket.accept", "headers": [(b"x-request-id", rid.encode())]})
            await session.run(receive, send)
        finally:
            self.open.discard(session)
            left = self.per_tenant.get(tenant, 1) - 1
            if left:
                self.per_tenant[tenant] = left
            else:
                self.per_tenant.pop(tenant, None)
            if self.gauge is not None:
                self.gauge.labels(label).dec()
            session.unpin()  # last: its upstream sockets close with it, whatever ended it

    async def _authenticate(self, headers: list[tuple[bytes, bytes]], rid: str, started: float) -> str:
        ex = Exchange(rid, "responses", headers, b"", {"model": ""}, started)
        ex.resource = HANDSHAKE
        if self.auth is not None:
            answered = self.auth(ex)  # the auth plugin's on_request: a coroutine (a hook may be a plain method)
            if answered is not None and not isinstance(answered, Reply):
                await answered
        return ex.tenant

    async def _sweep(self) -> None:
        """Every second, each open socket's key is checked again (the auth plugin's cache, refreshed by its
        revocation messages): a revoked key closes its sockets within about a second, running turn included."""
        try:
            while self.open:
                await asyncio.sleep(SWEEP_S)
                for session in list(self.open):
                    if session.revoked is not None:
                        continue
                    try:
                        await self._authenticate(session.handshake, session.ident, time.perf_counter())
                    except errors.GatewayError as exc:
                        if exc.status in (401, 403):
                            log.info("websocket %s: its key no longer authenticates; closing it", session.ident)
                            session.revoke(exc)
                    except Exception:
                        log.exception("websocket %s: checking its key failed", session.ident)
        finally:
            self.sweeper = None

    async def aclose(self) -> None:
        if self.sweeper is not None:
            self.sweeper.cancel()

    def _admit(self, tenant: str) -> None:
        settings = self.settings
        if len(self.open) >= settings.max_connections:
            raise errors.RateLimitError(
                f"this gateway process has {settings.max_connections} WebSocket connections open; retry later",
                code="websocket_connections_exhausted",
                headers=[RETRY_AFTER],
            )
        if self.per_tenant.get(tenant, 0) >= settings.max_per_tenant:
            raise errors.RateLimitError(
                f"tenant {tenant!r} has {settings.max_per_tenant} WebSocket connections open here; close one first",
                code="websocket_connections_exhausted",
                headers=[RETRY_AFTER],
            )

    async def _refuse(self, send: Send, error: errors.GatewayError, rid: str, what: str, started: float) -> None:
        await deny(send, error, rid)
        if self.pipeline.access is not None:
            refusal_line(self.pipeline.access, what, error, rid, started)

    async def refused(
        self, session: Session, error: errors.GatewayError, lane: str | None, turn: int, started: float
    ) -> None:
        """A turn refused before the pipeline (a bad message, an unknown model): its error event, counted and
        logged as the HTTP path counts and logs a request it refuses before routing."""
        await session.refuse(error, lane)
        socket: dict[str, Any] = {"sluice.transport": "websocket", "sluice.socket": session.ident, "sluice.turn": turn}
        if lane is not None:
            socket["sluice.stream_id"] = lane
        self.intake.refused(error, request.new_request_id(), "responses", started, None, socket)

    def warmed(self, session: Session, body: dict[str, Any], lane: str | None, turn: int, started: float) -> None:
        """A `generate: false` turn, answered by the session itself: its access line, and its model's pinned upstream
        sockets opened now, so that the turns after it find them open."""
        model = body.get("model")
        chain = self.intake.openai.chains.get(model) if isinstance(model, str) else None
        for target in chain or ():
            if target.backend in self.dialers:
                session.pin_for(target.backend).ensure()
        access = self.pipeline.access
        if access is not None:
            took = round((time.perf_counter() - started) * 1000.0, 3)
            fields: dict[str, Any] = {
                "request_id": request.new_request_id(),
                "tenant": session.tenant,
                "model": model if isinstance(model, str) else None,
                "stream": True,
                "status": 200,
                "total_ms": took,
                "overhead_ms": took,
                "sluice.transport": "websocket",
                "sluice.socket": session.ident,
                "sluice.turn": turn,
                "sluice.generate": False,
            }
            if lane is not None:
                fields["sluice.stream_id"] = lane
            access.info("responses %d", 200, extra={"fields": fields})

    async def run(
        self,
        session: Session,
        body: dict[str, Any],
        started: float,
        send: Responder,
        turn: int,
        plan: Plan | None = None,
    ) -> None:
        """One turn as a Responses create: built by the intake as the HTTP path builds one, through the pipeline."""
        self.turns += 1
        if self.counter is not None:
            self.counter.labels(self.tenant_label(session.tenant)).inc()
        intake = self.intake
        rid = request.new_request_id()
        raw = orjson.dumps(body)
        headers = [*session.headers, (b"x-request-id", rid.encode())]
        lane = send.lane
        try:
            ex = intake.openai.parse("responses", headers, raw, started, rid)
            ex.attributes["sluice.transport"] = "websocket"  # the turn's span and access line name its socket
            ex.attributes["sluice.socket"] = session.ident
            ex.attributes["sluice.turn"] = turn
            if lane is not None:
                ex.attributes["sluice.stream_id"] = lane
            intake.aim(intake.openai, ex)
        except errors.GatewayError as exc:
            await self.refused(session, exc, lane, turn, started)
            return
        if self.dialers:
            session.pin(ex, plan)
            try:
                await self.pipeline.serve(ex, send)
            finally:
                session.unplan(rid)
            return
        await self.pipeline.serve(ex, send)
