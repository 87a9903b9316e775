"""What self-hosted inference servers share: the OpenAI wire format on the hot path, health watched beside it.

vLLM, TGI, llama.cpp's server and Ollama all serve `/v1/chat/completions` (and more) in the OpenAI format, so
requests go through the HTTP provider's warm pool unchanged. What differs is how each says it is ready: a health
path of its own, and for some a "still loading the model" answer. That is polled in the background with httpx
(off the hot path): every LOADING_POLL_S while the server is loading or unreachable, every UP_POLL_S once it is up.

`server` is what the last check found: "unknown" (not checked yet), "loading", "up" or "down". It is the
server's own account, beside `health` (gateway/upstream/health.py), which is the connections' (up, down, warming). While
it is "loading", `loading` is True: a plain attribute, so that the request path can route around the backend
with an attribute read (gateway/pipeline.py), and listeners (gateway/upstream/warmup.py) hear of every change to count
it, warm the model again, and show it. `state` is what `/status` shows: "loading" while loading, else the
connections' state; `report()` adds the server's account to the connections' report.

Parameter quirks are refused before anything is sent: a server that answers one choice per request gets
`n > 1` back as a 400 naming the backend, rather than a silent single choice or a 500 (the cost per request is
one dict lookup).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import httpx

from gateway import errors
from gateway.upstream.providers.http import HttpProvider

if TYPE_CHECKING:
    from gateway.context import Exchange, Target
    from gateway.settings import PoolSettings, RemoteBackend

log = logging.getLogger("sluice.upstream")

LOADING_POLL_S = 1.0
UP_POLL_S = 10.0
HEALTH_TIMEOUT_S = 2.0

Listener = Callable[["SelfHostedProvider", str, str], None]  # (provider, before, after)


class SelfHostedProvider(HttpProvider):
    health_path: ClassVar[str] = "/health"  # from the server's root, i.e. base_url without its /v1
    one_choice: ClassVar[bool] = False  # the server answers one choice per request: n > 1 is refused here
    # reports_usage (gateway/upstream/providers/http.py) stays True: all four honour stream_options.include_usage.

    def __init__(self, name: str, backend: RemoteBackend, pool: PoolSettings) -> None:
        super().__init__(name, backend, pool)
        # Every configured endpoint's server root (base_url without its /v1): the backend is loading only while
        # none of them is up. Discovered replicas are asked through the DNS name the backend is configured with.
        urls = [backend.base_url] if backend.base_url is not None else backend.endpoints or [self.url]
        self.roots = [url.rstrip("/").removesuffix(self.base_path) for url in urls]
        self.server = "unknown"
        self.loading = False
        self.detail = ""  # what the last health check said, for logs and the status page
        self.listeners: list[Listener] = []
        self._check_headers = {**self.auth_headers(backend.api_key), **backend.headers}
        self._http: httpx.AsyncClient | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def state(self) -> str:
        return "loading" if self.loading else self.health.state

    def report(self) -> dict[str, Any]:
        """The connections' report (gateway/upstream/health.py) with the server's own account."""
        return {**super().report(), "state": self.state, "server": self.server, "server_detail": self.detail}

    def body(self, ex: Exchange, target: Target) -> bytes:
        if self.one_choice:
            n = ex.json.get("n")
            if n is not None and n != 1:
                raise errors.BadRequestError(
                    f"model {target.model!r} is served by {self.kind} (backend {self.name}), which returns one "
                    f"choice per request: n={n} is not supported",
                    param="n",
                    code="unsupported_parameter",
                )
        return super().body(ex, target)

    async def start(self) -> None:
        await super().start()
        verify: Any = self.ssl if self.ssl is not None else True
        self._http = httpx.AsyncClient(headers=self._check_headers, timeout=HEALTH_TIMEOUT_S, verify=verify)
        await self.check()  # known before the gateway reports ready
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def check(self) -> str:
        """Ask the server once; update `server` (and tell the listeners when it changed)."""
        assert self._http is not None, "provider not started"
        found = await asyncio.gather(*(self._ask(self._http, root) for root in self.roots))
        server, detail = next(
            (answer for answer in found if answer[0] == "up"),
            next((answer for answer in found if answer[0] == "loading"), found[0]),
        )
        self._set(server, detail)
        return server

    async def _ask(self, http: httpx.AsyncClient, root: str) -> tuple[str, str]:
        try:
            return await self.probe(http, root)
        except httpx.HTTPError as exc:
            return "down", f"{root}: {type(exc).__name__}: {exc}" if str(exc) else f"{root}: {type(exc).__name__}"

    async def probe(self, http: httpx.AsyncClient, root: str) -> tuple[str, str]:
        """(server, detail) from the server's health path: 200 up, 503 loading; any other answer is a server
        that is up without that path (a proxy in front, an older version)."""
        response = await http.get(root + self.health_path)
        if response.status_code == 503:
            return "loading", _message(response) or "503 from " + self.health_path
        if response.status_code == 200:
            return "up", ""
        return "up", f"{self.health_path} answered {response.status_code}"

    async def on_up(self, http: httpx.AsyncClient, root: str) -> None:
        """Called once each time the backend comes up, with the first endpoint's root: read what it says."""

    def _set(self, server: str, detail: str) -> None:
        before = self.server
        self.server, self.detail = server, detail
        self.loading = server == "loading"
        if server == before:
            return
        if server == "loading":
            log.warning("backend %s: loading its model (%s)", self.name, detail)
        elif server == "down":
            log.warning("backend %s: health check failed: %s", self.name, detail)
        elif before != "unknown":
            log.warning("backend %s: up (was %s)", self.name, before)
        if server == "up" and self._http is not None:
            task = asyncio.get_running_loop().create_task(self._on_up(self._http))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        for listener in self.listeners:
            try:
                listener(self, before, server)
            except Exception:
                log.exception("backend %s: a state listener failed", self.name)

    async def _on_up(self, http: httpx.AsyncClient) -> None:
        try:
            await self.on_up(http, self.roots[0])
        except (httpx.HTTPError, ValueError) as exc:
            log.info("backend %s: could not read its details: %s", self.name, exc)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(UP_POLL_S if self.server == "up" else LOADING_POLL_S)
            try:
                await self.check()
            except Exception:  # a server answering nonsense must not end the watch
                log.exception("backend %s: health check failed unexpectedly", self.name)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        if self._http is not None:
            await self._http.aclose()
        await super().aclose()


def _message(response: httpx.Response) -> str:
    """The error message of an OpenAI-style error body, if it is one."""
    try:
        body = response.json()
    except ValueError:
        return ""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or "")
    return str(error) if isinstance(error, str) else ""
