"""The targets of a Messages request: each backend seen through the Messages API, native or translated.

Each model's chain is wrapped once at start-up, target by target, so a fallback from a native backend to an
OpenAI-shaped one (or back) translates only where needed, and SLO fallback, failover and hedging work across
kinds. The pipeline relays what `send` returns as it would any upstream's answer: a Messages answer either way.

- `Native` (`anthropic`, `llamacpp`, and any backend with `messages_api: native`): the client's body goes as
  it came, byte for byte, to the backend's `/messages` (or `/messages/count_tokens`); only a different
  `upstream_model` is written into it, in place in the bytes (`renamed`), so `cache_control` breakpoints, key
  order and whitespace are the client's. The stream is relayed unchanged. The client's `anthropic-version`
  and `anthropic-beta` headers go along; its credentials never do (the backend's are sent).
- `Translated` (openai, azure, vllm, tgi, ollama, simulated by default): chat_request.py's translation, the
  backend's own provider, and chat_reply.py's translation of the answer, whole or event by event.
- `count_tokens` on a translated backend is answered here: an estimate of about 4 bytes of request a token,
  the rate limiter's own estimate.
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING, Any

import orjson

from gateway.context import Exchange, Target
from gateway.messages.chat_reply import StreamTranslator, whole
from gateway.messages.chat_request import to_chat, with_top_k
from gateway.messages.intake import COUNT_TOKENS
from gateway.upstream.providers.base import View

if TYPE_CHECKING:
    from collections.abc import Mapping

    from gateway.upstream.providers.base import Provider, UpstreamResponse
    from gateway.upstream.providers.http import HttpProvider

JSON_TYPE = (b"content-type", b"application/json")
# The client's headers a native backend is given (never its credentials).
FORWARDED = (b"anthropic-version", b"anthropic-beta")
# Where agent clients name their session (Claude Code's own header, the generic one).
SESSION_HEADERS = (b"x-claude-code-session-id", b"x-session-id")


def estimate(ex: Exchange) -> int:
    """The prompt's tokens as the gateway estimates them without a tokenizer: about 4 bytes a token."""
    return max(len(ex.body) // 4, 1)


def thinks(body: dict[str, Any]) -> bool:
    """Whether the client asked for thinking (`enabled` or `adaptive`)."""
    thinking = body.get("thinking")
    return isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")


def renamed(body: bytes, given: str, model: str) -> bytes:
    """`body` with its top-level model `given` replaced by `model`, touching no other byte; re-serialised only
    when the value cannot be found once, as written (an escaped name, or the same text elsewhere)."""
    pattern = re.compile(rb'"model"\s*:\s*' + re.escape(orjson.dumps(given)))
    found = pattern.findall(body)
    if len(found) == 1:
        return pattern.sub(lambda m: m.group(0)[: -len(orjson.dumps(given))] + orjson.dumps(model), body, count=1)
    data = orjson.loads(body)
    data["model"] = model
    return orjson.dumps(data)


class Canned:
    """An answer made here: whole, at once."""

    complete = True
    acquire_ms = 0.0

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.headers = [JSON_TYPE]
        self.body = body

    async def read(self) -> bytes:
        return self.body

    async def next_chunk(self) -> bytes:
        body, self.body = self.body, b""
        return body

    def close(self) -> None:
        return None


class WholeAnswer:
    """A whole chat completion, read as a Messages answer."""

    def __init__(self, inner: UpstreamResponse, model: str, thinking: bool) -> None:
        self.inner = inner
        self.model = model
        self.thinking = thinking
        self.status = inner.status
        self.headers = inner.headers
        self.acquire_ms = inner.acquire_ms
        self.complete = False  # the protocol's; nothing reads it of a wrapper
        self.done = False

    async def read(self) -> bytes:
        body = await self.inner.read()
        try:
            return whole(body, self.model, self.thinking)
        except (orjson.JSONDecodeError, AttributeError, TypeError, IndexError):
            return body  # not a chat completion: judged (and refused) as the upstream's nonsense

    async def next_chunk(self) -> bytes:
        if self.done:
            return b""
        self.done = True
        return await self.read()

    def close(self) -> None:
        self.inner.close()


class StreamAnswer:
    """A chat completions stream, read as a Messages stream."""

    def __init__(self, inner: UpstreamResponse, translator: StreamTranslator) -> None:
        self.inner = inner
        self.translator = translator
        self.status = inner.status
        self.headers = inner.headers
        self.acquire_ms = inner.acquire_ms
        self.complete = False
        self.ended = False

    async def next_chunk(self) -> bytes:
        """The next non-empty piece of the translated stream; b"" at its end."""
        while not self.ended:
            chunk = await self.inner.next_chunk()
            if not chunk:
                self.ended = True
                return self.translator.feed(b"\n\n") if self.translator.held.strip() else b""
            out = self.translator.feed(chunk)
            if out:
                return out
        return b""

    async def read(self) -> bytes:
        parts = []
        while chunk := await self.next_chunk():
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        self.inner.close()


class Wrapped(View):
    """A backend answering Messages requests: the backend's own provider but for how it sends them."""

    def __init__(self, inner: Provider) -> None:
        super().__init__(inner)
        # What a Messages answer reports is made here (translated or passed through), whatever the backend's.
        self.reports_usage = True
        self.usage_of_first_choice = False


def session_of(ex: Exchange) -> bytes | None:
    """The agent's session: its own header, else the Messages request's metadata.user_id."""
    for header in SESSION_HEADERS:
        value = ex.header(header)
        if value:
            return value
    metadata = ex.json.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    return user.encode() if isinstance(user, str) and user else None


def cache_key(tenant: str, session: bytes) -> str:
    """A prompt_cache_key for a tenant's session: its hash, so neither name leaves the gateway."""
    return hashlib.sha256(tenant.encode() + b"\0" + session).hexdigest()[:32]


class Translated(Wrapped):
    """An OpenAI-shaped backend answering Messages requests through chat completions."""

    def __init__(self, inner: Provider, keyed: bool = False) -> None:
        super().__init__(inner)
        self.keyed = keyed  # give a prompt_cache_key from the tenant and session (OpenAI's prompt_cache_key)

    async def send(self, ex: Exchange, target: Target) -> UpstreamResponse:
        if ex.endpoint == COUNT_TOKENS:
            return Canned(200, orjson.dumps({"input_tokens": estimate(ex)}))
        chat = with_top_k(to_chat(ex.json, target.upstream_model), ex.json, self.kind, target.backend)
        if self.keyed:
            session = session_of(ex)
            if session is not None:
                chat["prompt_cache_key"] = cache_key(ex.tenant, session)
        shadow = Exchange(ex.request_id, "chat/completions", ex.headers, orjson.dumps(chat), chat, ex.started)
        shadow.traceparent = ex.traceparent
        try:
            response = await self.inner.send(shadow, target)
        finally:
            # What choosing an endpoint cost, and which one: the request's, whichever exchange went upstream.
            ex.route_ms += shadow.route_ms
            if shadow.routed is not None:
                ex.routed = shadow.routed
        if response.status >= 400:
            return response  # the attempt loop judges it; the front door answers it in Anthropic's shape
        thinking = thinks(ex.json)
        if ex.stream:
            return StreamAnswer(response, StreamTranslator(ex.model, estimate(ex), thinking))
        return WholeAnswer(response, ex.model, thinking)


class Native(Wrapped):
    """A backend that serves the Messages API itself: the client's request passed through."""

    def __init__(self, inner: HttpProvider, version: str | None) -> None:
        super().__init__(inner)
        self.http = inner
        self.version = version  # anthropic-version sent when the client sent none (the anthropic type's)

    async def send(self, ex: Exchange, target: Target) -> UpstreamResponse:
        http = self.http
        headers = http.static_headers + b"x-request-id: " + ex.request_id.encode() + b"\r\n"
        if ex.traceparent is not None:
            headers += b"traceparent: " + ex.traceparent + b"\r\n"
        version_sent = False
        for name in FORWARDED:
            value = ex.header(name)
            if value is not None:
                headers += name + b": " + value + b"\r\n"
                version_sent = version_sent or name == b"anthropic-version"
        if not version_sent and self.version is not None:
            headers += b"anthropic-version: " + self.version.encode() + b"\r\n"
        body = ex.body
        if target.upstream_model != ex.model:
            body = renamed(body, ex.model, target.upstream_model)
        path = f"{http.base_path}/{ex.endpoint}".encode()
        return await http.endpoints.send(ex, http.route, b"POST", path, headers, body)


def chains(targets: dict[str, tuple[Target, ...]], providers: Mapping[str, Provider]) -> dict[str, tuple[Target, ...]]:
    """Each model's chain with every target seen through the Messages API (`providers`: backend -> wrapper)."""
    return {
        model: tuple(Target(t.model, t.backend, t.upstream_model, t.settings, providers[t.backend]) for t in chain)
        for model, chain in targets.items()
    }
