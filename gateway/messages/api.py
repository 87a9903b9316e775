"""The Messages API's front door: `POST /v1/messages` and `POST /v1/messages/count_tokens` into the pipeline.

This room's intake.py reads and checks the request, the targets are the model's chain seen through the
Messages API (backends.py), and the pipeline serves it like any request: auth (`x-api-key` or `Authorization:
Bearer`), rate limits charged with the answer's usage, the concurrency cap, the exact cache, SLO fallback,
deadlines and hedging, telemetry and the access log. It is a door of the intake's (server/intake.py): its own
parse and chains, and a responder that changes one thing: every error leaves in Anthropic's shape
(refusals.py), whether the gateway, a plugin or the upstream made it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from gateway import errors
from gateway.messages import refusals
from gateway.messages.backends import Native, Translated, chains
from gateway.messages.intake import COUNT_TOKENS, MESSAGES, parse
from gateway.server.intake import Door

if TYPE_CHECKING:
    from starlette.types import Message

    from gateway.context import Target
    from gateway.server.responder import Responder
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


class AnthropicErrors:
    """A responder on this route: errors rewritten into Anthropic's shape, the rest passed on as it is."""

    __slots__ = ("held", "inner", "parts")

    def __init__(self, inner: Responder) -> None:
        self.inner = inner
        self.held: Message | None = None  # an error's head, until its body is whole
        self.parts: list[bytes] = []

    async def send(self, message: Message) -> None:
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
                await self.inner.answer(refusals.status_of(status), headers, body)
                return
            if body.startswith(ERROR_EVENT_START):  # the pipeline's end of a failed stream
                message = {**message, "body": refusals.stream_error(body)}
        await self.inner.send(message)

    async def answer(self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> None:
        if status >= 400:
            body = refusals.anthropic_body(status, body)
            headers = refusals.error_headers(status, headers, body)
            status = refusals.status_of(status)
        await self.inner.answer(status, headers, body)

    def watch(self, gone: Callable[[], None]) -> None:
        self.inner.watch(gone)

    def unwatch(self) -> None:
        self.inner.unwatch()


def unknown_model(model: str) -> errors.GatewayError:
    return errors.NotFoundError(f"model: {model} (not a model of this gateway)", param="model")


class Messages:
    """The Messages API's targets and handlers; built at start-up."""

    def __init__(self, settings: Settings, upstreams: Upstreams) -> None:
        wrappers: dict[str, Native | Translated] = {}
        for name, backend in settings.backends.items():
            http = upstreams.http.get(name)  # None: the simulated kind, which writes no request to pass through
            if native(backend) and http is not None:
                wrappers[name] = Native(http, getattr(backend, "anthropic_version", None))
            else:
                wrappers[name] = Translated(upstreams.providers[name], getattr(backend, "prompt_cache_key", False))
        self.chains: dict[str, tuple[Target, ...]] = chains(upstreams.chains, wrappers)
        native_ones = [name for name, wrapper in wrappers.items() if isinstance(wrapper, Native)]
        # The intake's door for this API: its own parse and chains, no routing step, Anthropic's errors.
        self.door = Door(parse, self.chains, unknown_model, routed=False, wrap=AnthropicErrors)
        if native_ones:  # said once at start-up: which backends get the client's Messages bytes as they are
            log.info("messages API: passed through to %s; translated for the others", ", ".join(native_ones))
