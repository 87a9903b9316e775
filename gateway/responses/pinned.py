"""A client socket's own WebSocket to an OpenAI or Azure backend: opened once, pinned, reused every turn.

OpenAI's (and Azure's) WebSocket mode keeps the connection's last response in memory, so a turn that continues it
sends only its new input and `previous_response_id`, with nothing to read from a store. That cache is per
connection, so each client socket gets its own upstream socket per backend (`Pin`), never shared: another
socket, another tenant's above all, never sees it. It is opened in the background at the socket's first turn
that names a model on the backend (Codex's `generate: false` warm-up is one), so the turns after it find it open
and authenticated; a turn never waits for it.

A turn on such a backend goes through `Pinned`, the backend's provider for this socket only: over the pinned
socket when it is open and idle, with the client's own create (its `previous_response_id` unchanged when the
upstream socket made that response, else the conversation the session expanded); over the HTTP/SSE path
otherwise (the socket is still opening, another lane is using it, it was refused, it closed), and when sending
on it fails before any event came back. Every stage runs the same either way: the turn is one request through
the pipeline.

When the upstream refuses the upgrade with a 4xx (it does not serve the mode: a proxy, an older server), the
client socket stops asking, and the backend is not asked again by any socket for `REFUSED_S`; another failure
(connect error, 5xx, a drop) is retried at a later turn after `RETRY_S`. `websocket: off` on the backend turns it
off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import orjson

from gateway.context import Exchange, Target
from gateway.settings import AzureBackend, OpenAIBackend
from gateway.upstream.connection import PoolError
from gateway.upstream.providers.http import HttpProvider
from gateway.upstream.websocket import SocketClosed, SocketRefused, UpstreamSocket

if TYPE_CHECKING:
    from gateway.responses.index import Indexing
    from gateway.settings import RemoteBackend, Settings
    from gateway.upstream.attempts import Upstreams
    from gateway.upstream.providers.base import UpstreamResponse

log = logging.getLogger("sluice.websocket")

REFUSED_S = 300.0  # a backend that refused the upgrade with a 4xx is not asked again for this long
RETRY_S = 10.0  # after another failure, a socket asks again no sooner than this
NOT_SENT = frozenset({"type", "stream", "stream_options", "background"})
# Headers of the client's handshake passed on to the upstream's: they name the protocol's version, or the session.
PASSED = frozenset({b"openai-beta", b"session_id", b"originator"})
Plan = tuple[dict[str, Any], str]  # a turn's create as the client sent it, and the id it continues


class Dialer:
    """A backend's WebSocket mode, for every socket of this process: where it is, the gateway's credential for
    it, and whether it was refused lately."""

    def __init__(self, name: str, provider: HttpProvider, backend: RemoteBackend, target: Target) -> None:
        self.name = name
        self.provider = provider
        parts = urlsplit(provider.url)
        scheme = "wss" if parts.scheme == "https" else "ws"
        probe = Exchange("websocket", "responses", [], b"", {"model": target.upstream_model}, 0.0)
        self.url = f"{scheme}://{parts.netloc}{provider.path(probe, target).decode()}"
        headers = {"user-agent": "sluice", **provider.auth_headers(backend.api_key)}
        headers.update({k.lower(): v for k, v in backend.headers.items()})
        self.headers = [(k.encode(), v.encode()) for k, v in headers.items()]
        self.connect_s = backend.timeouts.connect_s
        self.first_byte_s = backend.timeouts.first_byte_s
        self.idle_read_s = backend.timeouts.idle_read_s
        self.refused_until = 0.0
        self.opened = 0  # upstream sockets opened by this process

    async def open(self, passed: list[tuple[bytes, bytes]]) -> UpstreamSocket:
        socket = await UpstreamSocket.open(
            self.url, [*self.headers, *passed], self.provider.ssl, self.connect_s, self.idle_read_s
        )
        self.opened += 1
        return socket


class Pin:
    """One client socket's upstream socket to one backend: opened in the background, kept while it lasts."""

    def __init__(self, dialer: Dialer, handshake: list[tuple[bytes, bytes]], ident: str) -> None:
        self.dialer = dialer
        self.passed = [(k, v) for k, v in handshake if k in PASSED]
        self.ident = ident
        self.socket: UpstreamSocket | None = None
        self.opening: asyncio.Task[None] | None = None
        self.retry_at = 0.0
        self.off = False  # refused with a 4xx: this client socket does not ask again
        self.plans: dict[str, Plan] = {}  # request id -> the turn's create as sent by the client

    def ensure(self) -> None:
        """Start opening the socket unless it is open, opening, or not to be asked now."""
        socket = self.socket
        if self.off or self.opening is not None or (socket is not None and not socket.closed):
            return
        now = time.monotonic()
        if now < self.retry_at or now < self.dialer.refused_until:
            return
        self.opening = asyncio.get_running_loop().create_task(self._open())

    async def _open(self) -> None:
        dialer = self.dialer
        try:
            socket = await dialer.open(self.passed)
            if self.off:  # the client socket closed meanwhile
                socket.abort()
                return
            self.socket = socket
            log.debug("websocket %s: upstream socket to %s open", self.ident, dialer.name)
        except SocketRefused as exc:
            if 400 <= exc.status < 500:
                self.off = True
                dialer.refused_until = time.monotonic() + REFUSED_S
                log.info("backend %s refused the WebSocket mode (%d): its turns go over HTTP", dialer.name, exc.status)
            else:
                self.retry_at = time.monotonic() + RETRY_S
        except PoolError as exc:
            self.retry_at = time.monotonic() + RETRY_S
            log.info("websocket %s: no upstream socket to %s (%s); HTTP meanwhile", self.ident, dialer.name, exc)
        finally:
            self.opening = None

    def ready(self) -> UpstreamSocket | None:
        """The socket if a turn can use it now; else None (and an open is started if it is due)."""
        socket = self.socket
        if socket is not None and socket.usable:
            return socket
        if socket is not None and socket.closed:
            self.socket = None  # closed by the upstream (its lifetime) or broken: a new one is opened now
        self.ensure()
        return None

    def close(self) -> None:
        self.off = True  # an open still under way finds it so, and closes what it opened
        if self.opening is not None:
            self.opening.cancel()
        if self.socket is not None:
            self.socket.abort()


class Pinned:
    """A backend's Responses provider for one client socket: its pinned upstream socket, else HTTP."""

    def __init__(self, inner: Indexing, pin: Pin) -> None:
        self.inner = inner
        self.pin = pin
        self.kind = inner.kind
        self.system = inner.system
        self.url = inner.url
        self.health = inner.health
        self.reports_usage = inner.reports_usage
        self.usage_of_first_choice = inner.usage_of_first_choice

    async def send(self, ex: Exchange, target: Target) -> UpstreamResponse:
        pin = self.pin
        socket = pin.ready()
        if socket is None:
            return await self.inner.send(ex, target)
        try:
            message, compact = self._message(ex, target, socket)
            turn = await socket.create(message, pin.dialer.first_byte_s)
            if compact and turn.status == 400 and b"previous_response_not_found" in turn.error_body:
                # The upstream no longer holds it (its cache is its own to evict): the whole conversation instead.
                turn = await socket.create(self._message(ex, target, None)[0], pin.dialer.first_byte_s)
        except SocketClosed as exc:
            # Nothing of this turn reached the client: it goes over HTTP, and a later turn opens a new socket.
            log.info(
                "websocket %s: upstream socket to %s lost (%s); the turn over HTTP", pin.ident, target.backend, exc
            )
            return await self.inner.send(ex, target)
        if turn.status < 400:
            ex.attributes["sluice.upstream_transport"] = "websocket"
        return self.inner.noted(turn, ex, target)

    def _message(self, ex: Exchange, target: Target, socket: UpstreamSocket | None) -> tuple[bytes, bool]:
        """The `response.create` to send: the client's own when the socket made the response it continues (the
        upstream holds it), else the body the HTTP path would send (the conversation expanded, or as it came);
        and whether it was the client's own."""
        plan = self.pin.plans.get(ex.request_id)
        compact = plan is not None and socket is not None and plan[1] == socket.last
        source = plan[0] if plan is not None and compact else ex.json
        message: dict[str, Any] = {"type": "response.create"}
        for key, value in source.items():
            if key not in NOT_SENT:
                message[key] = value
        if target.upstream_model != ex.model:
            message["model"] = target.upstream_model
        fields = ex.upstream_fields
        extra = None if fields is None else fields.get(target.backend)
        if extra:
            message.update(extra)
        return orjson.dumps(message), compact


def dialers(settings: Settings, upstreams: Upstreams) -> dict[str, Dialer]:
    """The backends whose turns may take a pinned upstream socket: OpenAI and Azure with `websocket: auto`, one
    base URL, the Responses API."""
    found: dict[str, Dialer] = {}
    for name, backend in settings.backends.items():
        if not isinstance(backend, OpenAIBackend | AzureBackend) or backend.websocket != "auto":
            continue
        provider = upstreams.providers[name]
        target = next((t for t in upstreams.targets.values() if t.backend == name), None)
        if backend.responses_api and backend.base_url is not None and isinstance(provider, HttpProvider) and target:
            found[name] = Dialer(name, provider, backend, target)
    return found
