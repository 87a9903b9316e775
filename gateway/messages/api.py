"""The Messages API's front door: `POST /v1/messages` and `POST /v1/messages/count_tokens` into the pipeline.

The intake reads and checks the request (intake.py), the targets are the model's chain seen through the
Messages API (backends.py), and the pipeline serves it like any request: auth (`x-api-key` or `Authorization:
Bearer`), rate limits charged with the answer's usage, the concurrency cap, the exact cache, SLO fallback,
deadlines and hedging, telemetry and the access log. The responder is the client's `send` with one change:
every error leaves in Anthropic's shape (refusals.py), whether the gateway, a plugin or the upstream made it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, cast

from gateway import errors
from gateway.messages import refusals
from gateway.messages.backends import Native, Translated, Wrapped, chains
from gateway.messages.intake import COUNT_TOKENS, MESSAGES, parse
from gateway.server import request
from gateway.upstream.attempts import around_loading
from gateway.upstream.providers.http import HttpProvider

if TYPE_CHECKING:
    from collections.abc import Sequence

    from starlette.types import Message, Receive, Scope, Send

    from gateway.context import Target
    from gateway.pipeline import Pipeline
    from gateway.server.direct import Direct
    from gateway.settings import Settings
    from gateway.upstream.attempts import Upstreams

log = logging.getLogger("sluice.messages")

PATHS = {"/v1/messages": MESSAGES, "/v1/messages/count_tokens": COUNT_TOKENS}
# Backend types that serve the Messages API themselves, unless the config says otherwise (`messages_api`).
NATIVE_KINDS = frozenset({"anthropic", "llamacpp"})
ERROR_EVENT_START = b'data: {"error"'


def native(backend: Any) -> bool:
    chosen = getattr(backend, "messages_api", None)
    return chosen == "native" if chosen is not None else backend.type in NATIVE_KINDS


class Responder:
    """The client's ASGI `send` on this route: errors rewritten into Anthropic's shape, the rest as it is."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.held: Message | None = None  # an error's head, until its body is whole
        self.parts: list[bytes] = []

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            if message["status"] >= 400:
                self.held = message
                return
        elif message["type"] == "http.response.body":
            body: bytes = message.get("body", b"")
            if self.held is not None:
                self.parts.append(body)
                if message.get("more_body", False):
                    return
                held, self.held = self.held, None
                status = held["status"]
                body = refusals.anthropic_body(status, b"".join(self.parts))
                headers = refusals.error_headers(status, held["headers"], body)
                head = {**held, "status": refusals.status_of(status), "headers": headers}
                await self.send(head)
                await self.send({"type": "http.response.body", "body": body, "more_body": False})
                return
            if body.startswith(ERROR_EVENT_START):  # the pipeline's end of a failed stream
                message = {**message, "body": refusals.stream_error(body)}
        await self.send(message)


class Answering:
    """The protocol's direct cycle for this route: whole answers through it, errors in Anthropic's shape."""

    def __init__(self, direct: Direct) -> None:
        self.direct = direct

    @property
    def disconnected(self) -> bool:
        return self.direct.disconnected

    @property
    def gone(self) -> Any:
        return self.direct.gone

    @gone.setter
    def gone(self, value: Any) -> None:
        self.direct.gone = value

    async def answer(self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> None:
        if status >= 400:
            body = refusals.anthropic_body(status, body)
            headers = refusals.error_headers(status, headers, body)
            status = refusals.status_of(status)
        await self.direct.answer(status, headers, body)


class Messages:
    """The Messages API's targets and handlers; built at start-up."""

    def __init__(self, settings: Settings, upstreams: Upstreams, pipeline: Pipeline) -> None:
        self.upstreams = upstreams
        self.pipeline = pipeline
        self.max_body = settings.limits.max_body_bytes
        wrappers: dict[str, Wrapped] = {}
        for name, backend in settings.backends.items():
            provider = upstreams.providers[name]
            if native(backend) and isinstance(provider, HttpProvider):
                wrappers[name] = Native(provider, getattr(backend, "anthropic_version", None))
            else:
                wrappers[name] = Translated(provider, getattr(backend, "prompt_cache_key", False))
        self.chains: dict[str, tuple[Target, ...]] = chains(upstreams.chains, wrappers)
        native_ones = [name for name, wrapper in wrappers.items() if isinstance(wrapper, Native)]
        if native_ones:  # said once at start-up: which backends get the client's Messages bytes as they are
            log.info("messages API: passed through to %s; translated for the others", ", ".join(native_ones))

    async def handle(self, scope: Scope, receive: Receive, send: Send, endpoint: str) -> None:
        """A request from the ASGI app."""
        started: float = scope.get(request.ARRIVED) or time.perf_counter()
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        rid = request.request_id(headers)
        responder = Responder(send)
        try:
            body = await request.read_body(receive, headers, self.max_body)
        except request.ClientGone:
            return
        except errors.GatewayError as exc:
            await self._reject(responder, exc, rid, endpoint, started)
            return
        await self._serve(endpoint, headers, body, started, rid, receive, responder, None)

    async def handle_direct(self, endpoint: str, direct: Direct) -> None:
        """A request from the HTTP/1.1 protocol's direct path (server/direct.py)."""
        headers = direct.headers
        rid = direct.request_id
        responder = Responder(direct.send)
        try:
            body = direct.whole()
            if body is None:
                body = await request.read_body(direct.receive, headers, self.max_body)
            else:
                body = request.taken(body, direct.encoding, self.max_body)
        except request.ClientGone:
            return
        except errors.GatewayError as exc:
            await self._reject(responder, exc, rid, endpoint, direct.arrived)
            return
        await self._serve(endpoint, headers, body, direct.arrived, rid, direct.receive, responder, direct)

    async def _serve(
        self,
        endpoint: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        started: float,
        rid: str,
        receive: Receive,
        responder: Responder,
        direct: Direct | None,
    ) -> None:
        try:
            ex = parse(endpoint, headers, body, started, rid)
        except errors.GatewayError as exc:
            await self._reject(responder, exc, rid, endpoint, started)
            return
        ex.mark("parse", started)
        chain = self.chains.get(ex.model)
        if chain is None:
            error = errors.NotFoundError(f"model: {ex.model} (not a model of this gateway)", param="model")
            await self._reject(responder, error, rid, endpoint, started, ex.model)
            return
        ex.targets = list(chain)
        if self.upstreams.loading:
            around_loading(ex, self.upstreams.loading)
        answering = cast("Direct", Answering(direct)) if direct is not None else None
        await self.pipeline.serve(ex, receive, responder, answering)

    async def _reject(
        self,
        responder: Responder,
        error: errors.GatewayError,
        rid: str,
        endpoint: str,
        started: float,
        model: str | None = None,
    ) -> None:
        await self.pipeline.refuse(responder, error, rid, endpoint, started, model)
