"""The admin surface: `/status`, `/metrics`, `/readyz`'s detail and the console; who may see them; where.

Who sees them is decided once, at start-up: on a listener of their own if `admin.port` is set; else on the
tenants' port behind `admin.token`, or open there only when that port is loopback (the quickstart: nobody else
can reach it). The listener is served by the same HTTP/1.1 protocol as the tenants' port (its limits on heads
and slow clients) from a socket this process opens once its runtime has started; the workers of
`sluice serve --workers N` each open it with SO_REUSEPORT, so the kernel spreads scrapes over them as it spreads
requests on the main port. The app (gateway/app.py) composes this with its own routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp
from uvicorn.server import ServerState

from gateway import __version__, errors, handoff
from gateway.server.console import Console
from gateway.server.protocol import GatewayProtocol
from gateway.server.request import request_id

if TYPE_CHECKING:
    from gateway.runtime import Runtime
    from gateway.settings import Settings

log = logging.getLogger("sluice")

Refused = Callable[[str, errors.GatewayError, str], None]  # (what, error, request id): the app's access line
Endpoint = Callable[[Request], Any]


def status_of(runtime: Runtime) -> dict[str, Any]:
    """What `/status` and `/readyz`'s detail show: readiness, each backend's state, Redis, the plugins."""
    store = runtime.store
    return {
        "status": "ready" if runtime.ready else "starting",
        "version": __version__,
        "uptime_s": round(time.monotonic() - runtime.created, 1),
        "backends": runtime.upstreams.report(),
        "redis": {
            "configured": store is not None,
            "reachable": None if store is None else not store.down,
            # How long calls still fail untried after the last failure (the breaker's cool-down): 0 once the
            # next call will be tried, which is when a restarted Redis is found again.
            "retry_in_s": None if store is None else round(max(store.retry_in_s(), 0.0), 3),
        },
        "plugins": list(runtime.settings.plugins),
    }


def loopback(host: str) -> bool:
    """Whether a listen address is reachable from this host only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


class Admin:
    """The admin routes, their access check and their listener; built once with the app."""

    def __init__(
        self,
        settings: Settings,
        runtime: Callable[[], Runtime | None],
        refused: Refused,
        healthz: Endpoint,
        handlers: dict[Any, Callable[..., Any]],
    ) -> None:
        self.settings = settings
        self.runtime = runtime
        self.refused = refused
        admin = settings.admin
        self.token = b"Bearer " + admin.token.encode() if admin.token else None
        # Served on the tenants' port (no listener of their own) to whom may see them there.
        self.here = admin.port is None and (self.token is not None or loopback(settings.listen.host))
        self.listener: AdminListener | None = None
        # The latency console (server/console.py) goes wherever /status goes, to whom it goes.
        self.console = (
            Console(runtime, self.allowed, self.unauthorized, status_of).routes() if admin.console.enabled else []
        )
        self.site = (
            Starlette(
                routes=[
                    Route("/healthz", healthz),
                    Route("/readyz", self.listener_readyz),
                    Route("/status", self.status),
                    Route("/metrics", self.metrics),
                    *self.console,
                ],
                exception_handlers=handlers,
            )
            if admin.port is not None
            else None
        )

    def routes(self) -> list[Route]:
        """The admin routes the tenants' port serves: all of them where they are served there, else none."""
        return [Route("/status", self.status), Route("/metrics", self.metrics), *self.console] if self.here else []

    async def start(self) -> None:
        """Open the listener, if there is one; say once where the admin routes are and who may see them."""
        admin = self.settings.admin
        if self.site is not None and admin.port is not None:
            shared = handoff.SUPERVISOR in os.environ  # every worker listens on it
            self.listener = AdminListener(self.site, admin.host, admin.port, shared=shared)
            try:
                await self.listener.start()
            except OSError as exc:
                log.error("admin: cannot listen on %s:%d: %s", admin.host, admin.port, exc.strerror or exc)
                raise
            guarded = " (admin.token required)" if self.token is not None else ""
            where = f"http://{admin.host}:{admin.port}"
            log.info("admin: /status, /metrics, /readyz and /console on %s%s", where, guarded)
        elif self.here:
            guarded = "admin.token required" if self.token is not None else "open: the port is loopback"
            log.info("admin: /status, /metrics, /readyz and /console on the tenants' port (%s)", guarded)
        else:
            log.warning(
                "admin: /status and /metrics are not served on %s (not loopback): set admin.port or admin.token",
                self.settings.listen.host,
            )

    async def aclose(self) -> None:
        if self.listener is not None:
            await self.listener.aclose()

    def allowed(self, request: Request) -> bool:
        """Whether a request may see the admin routes: no token is set, or it carries the token."""
        token = self.token
        if token is None:
            return True
        given = request.headers.get("authorization", "").encode()
        return hmac.compare_digest(given, token)

    def unauthorized(self, request: Request) -> Response:
        error = errors.AuthenticationError(
            "this route needs the gateway's admin token: Authorization: Bearer <admin.token>",
            code="invalid_admin_token",
        )
        rid = request_id(request.scope["headers"])
        self.refused(f"{request.method} {request.url.path}", error, rid)
        headers = {"www-authenticate": "Bearer", "x-request-id": rid}
        return Response(error.body(), status_code=error.status, headers=headers, media_type="application/json")

    async def readyz(self, request: Request) -> Response:
        """200 once every backend's warm-up was attempted and the plugins have started; never on upstreams' health.

        The body has the same detail as /status only where the admin routes are served to this caller."""
        return self._readiness(detail=self.here and self.allowed(request))

    async def listener_readyz(self, request: Request) -> Response:
        return self._readiness(detail=self.allowed(request))

    def _readiness(self, *, detail: bool) -> Response:
        runtime = self.runtime()
        if runtime is None:
            return Response(b'{"status":"starting"}', status_code=503, media_type="application/json")
        code = 200 if runtime.ready else 503
        if not detail:
            body = b'{"status":"ready"}' if runtime.ready else b'{"status":"starting"}'
            return Response(body, status_code=code, media_type="application/json")
        return Response(orjson.dumps(status_of(runtime)), status_code=code, media_type="application/json")

    async def status(self, request: Request) -> Response:
        """The gateway's state for people and scripts: backends (state, warm connections, last error), Redis."""
        if not self.allowed(request):
            return self.unauthorized(request)
        runtime = self.runtime()
        body = status_of(runtime) if runtime is not None else {"status": "starting"}
        return Response(orjson.dumps(body, option=orjson.OPT_INDENT_2), media_type="application/json")

    async def metrics(self, request: Request) -> Response:
        if not self.allowed(request):
            return self.unauthorized(request)
        runtime = self.runtime()
        if runtime is None:
            return Response(b"gateway is starting\n", status_code=503, media_type="text/plain")
        body, content_type = await runtime.telemetry.exposition(request.headers.get("accept", ""))
        return Response(body, headers={"content-type": content_type})


class AdminListener:
    def __init__(self, app: ASGIApp, host: str, port: int, *, shared: bool) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.shared = shared  # several workers listen on the same port
        self.state = ServerState()
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            http=GatewayProtocol,
            lifespan="off",
            access_log=False,
            proxy_headers=False,
            server_header=False,
            log_config=None,
        )
        config.load()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self.shared:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((self.host, self.port))
            sock.listen(config.backlog)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        state = self.state

        def protocol() -> asyncio.Protocol:
            return config.http_protocol_class(config=config, server_state=state, app_state={})  # type: ignore[call-arg]

        self.server = await asyncio.get_running_loop().create_server(protocol, sock=sock)

    async def aclose(self) -> None:
        if self.server is None:
            return
        self.server.close()
        for connection in list(self.state.connections):
            connection.shutdown()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.server.wait_closed(), 1.0)
        self.server = None
