"""Step 1 of every request, on every front door: read it, parse it, find its targets, or refuse it.

A front door is a `Door`: how its requests are parsed (OpenAI's endpoints: request.parse; Anthropic's Messages
API: its own), the chains its models have (the Messages API sees each backend through its translation), what an
unknown model is told, and the responder its answers go through (Anthropic's errors). The intake reads the
body whichever server carried it (the protocol's direct cycle, or ASGI), builds the Exchange in this one place,
lets the routing step replace its targets (`route`: the Responses API's capable backends, a background job's
runner), and hands it to the pipeline with its responder. A request refused here is answered, counted and
logged as the pipeline answers, counts and logs one it refuses later.

A front door that carries no HTTP request of its own (a WebSocket turn) calls `exchange` and `refuse` itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gateway import errors
from gateway.server import request
from gateway.server.reply import send_error
from gateway.server.responder import Asgi
from gateway.telemetry.access import refusal_line
from gateway.upstream.attempts import around_loading

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from gateway.context import Exchange, Target
    from gateway.server.direct import Direct
    from gateway.server.responder import Responder
    from gateway.telemetry.recorder import Telemetry
    from gateway.upstream.attempts import Upstreams


class Parse(Protocol):
    def __call__(
        self,
        endpoint: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        started: float,
        rid: str,
        path_model: str | None = None,
    ) -> Exchange: ...


def unknown_model(model: str) -> errors.GatewayError:
    return errors.NotFoundError(f"The model `{model}` does not exist", param="model")


@dataclass(frozen=True, slots=True)
class Door:
    """A front door: how its requests become Exchanges and how its answers go out."""

    parse: Parse
    chains: Mapping[str, tuple[Target, ...]]
    unknown: Callable[[str], errors.GatewayError] = unknown_model
    routed: bool = True  # the routing step applies (the OpenAI endpoints: Responses, background jobs)
    wrap: Callable[[Responder], Responder] | None = None  # answers in another shape than OpenAI's


Serve = Callable[["Exchange", "Responder"], Awaitable[None]]
Route = Callable[["Exchange"], None]


class Intake:
    """Step 1 for every door; `serve` is the pipeline's one entry (steps 2 to 6)."""

    def __init__(
        self,
        upstreams: Upstreams,
        max_body: int,
        serve: Serve,
        route: Route | None = None,
        telemetry: Telemetry | None = None,
        access: logging.Logger | None = None,
    ) -> None:
        self.upstreams = upstreams
        self.max_body = max_body
        self.serve = serve
        self.route = route
        self.telemetry = telemetry
        self.access = access
        self.openai = Door(request.parse, upstreams.chains)  # the OpenAI endpoints' door

    async def asgi(
        self, door: Door, scope: Scope, receive: Receive, send: Send, endpoint: str, path_model: str | None = None
    ) -> None:
        """A request from the ASGI app (or a caller that speaks ASGI: the cache's prefill, evaluations)."""
        started: float = scope.get(request.ARRIVED) or time.perf_counter()
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        rid = request.request_id(headers)
        responder: Responder = Asgi(receive, send)
        if door.wrap is not None:
            responder = door.wrap(responder)
        ex: Exchange | None = None
        try:
            body = await request.read_body(receive, headers, self.max_body)
            ex = door.parse(endpoint, headers, body, started, rid, path_model)
            self.aim(door, ex)
        except request.ClientGone:
            return
        except errors.GatewayError as exc:
            await self.refuse(responder, exc, rid, endpoint, started, ex.model if ex is not None else None)
            return
        await self.serve(ex, responder)

    async def direct(self, door: Door, cycle: Direct, endpoint: str, path_model: str | None = None) -> None:
        """A request on a proxy route from the HTTP/1.1 protocol (server/direct.py), without the ASGI cycle.

        Step 1 in this one frame, the pipeline awaited from it: every frame between the protocol and the pool
        is one a waiting request holds (tests/integration/gateway/test_frames.py counts them)."""
        responder: Responder = cycle if door.wrap is None else door.wrap(cycle)
        ex: Exchange | None = None
        try:
            body = cycle.whole()  # the common case: the body came with the head
            if body is None:
                body = await request.read_body(cycle.receive, cycle.headers, self.max_body)
            else:
                body = request.taken(body, cycle.encoding, self.max_body)
            ex = door.parse(endpoint, cycle.headers, body, cycle.arrived, cycle.request_id, path_model)
            self.aim(door, ex)
        except request.ClientGone:
            return
        except errors.GatewayError as exc:
            model = ex.model if ex is not None else None
            await self.refuse(responder, exc, cycle.request_id, endpoint, cycle.arrived, model)
            return
        await self.serve(ex, responder)

    async def built(
        self, scope: Scope, receive: Receive, send: Send, what: str, build: Callable[[float, str], Exchange]
    ) -> None:
        """A request without a body to parse (an operation on a stored object): `build(started, rid)` makes its
        Exchange from the path, or refuses it."""
        started: float = scope.get(request.ARRIVED) or time.perf_counter()
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        rid = request.request_id(headers)
        responder = Asgi(receive, send)
        try:
            await request.read_body(receive, headers, self.max_body)  # nothing is expected, but read it off
            ex = build(started, rid)
        except request.ClientGone:
            return
        except errors.GatewayError as exc:
            await self.refuse(responder, exc, rid, what, started)
            return
        await self.serve(ex, responder)

    def aim(self, door: Door, ex: Exchange) -> None:
        """The parsed Exchange's targets: its model's chain at this door, then the routing step's say."""
        ex.mark("parse", ex.started)
        chain = door.chains.get(ex.model)
        if chain is None:
            raise door.unknown(ex.model)
        ex.targets = list(chain)
        if self.upstreams.loading:  # empty unless a self-hosted backend is still loading its model
            around_loading(ex, self.upstreams.loading)
        if door.routed and self.route is not None:
            self.route(ex)

    async def refuse(
        self,
        responder: Responder,
        error: errors.GatewayError,
        rid: str,
        what: str,
        started: float,
        model: str | None = None,
    ) -> None:
        """A request refused before it was routed (bad JSON, unknown model): answered, counted and logged."""
        if self.telemetry is not None:
            self.telemetry.rejected(error.status)
        await send_error(responder.send, error, rid)
        if self.access is not None:
            refusal_line(self.access, what, error, rid, started, model)

    def refused(
        self,
        error: errors.GatewayError,
        rid: str,
        what: str,
        started: float,
        model: str | None = None,
        extra: Mapping[str, object] | None = None,
    ) -> None:
        """Counted and logged: a refusal answered by the caller in its own form (a WebSocket's error event)."""
        if self.telemetry is not None:
            self.telemetry.rejected(error.status)
        if self.access is not None:
            refusal_line(self.access, what, error, rid, started, model, extra)
