"""The application: the proxy endpoints straight to the pipeline, Starlette for everything else.

Under the gateway's own HTTP/1.1 protocol (server/protocol.py) a POST to a proxy path does not go through ASGI
at all: the protocol asks `direct_route` for the path's handler and runs the pipeline on the parsed request
(server/direct.py). Under any other server (or for another method) the ASGI callable matches the proxy paths with
one dict lookup and goes straight to the pipeline, without routing, middleware or Request objects; health,
readiness, the model list and unknown paths go through Starlette, where per-request cost does not matter.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncIterator

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway import errors, handoff
from gateway.config import load
from gateway.context import Exchange
from gateway.messages.api import PATHS as MESSAGE_PATHS
from gateway.responses import stored
from gateway.responses.api import JOB_PREFIX
from gateway.responses.api import PREFIXES as RESPONSE_PREFIXES
from gateway.responses.sockets import PATHS as SOCKET_PATHS
from gateway.responses.sockets import deny
from gateway.runtime import Runtime
from gateway.server import lifeline
from gateway.server.admin import Admin
from gateway.server.direct import Handler
from gateway.server.reply import send_error
from gateway.server.request import request_id
from gateway.settings import Listen, Settings
from gateway.telemetry.access import refusal_line

log = logging.getLogger("sluice")

ENDPOINTS = {
    "/v1/chat/completions": "chat/completions",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
    # The same paths without /v1, as some clients are configured with the bare host as base URL.
    "/chat/completions": "chat/completions",
    "/completions": "completions",
    "/embeddings": "embeddings",
    # Azure OpenAI's v1 form, which `AzureOpenAI` and `OpenAI(base_url=".../openai/v1")` use.
    "/openai/v1/chat/completions": "chat/completions",
    "/openai/v1/completions": "completions",
    "/openai/v1/embeddings": "embeddings",
    "/openai/v1/responses": "responses",
    "/responses": "responses",
}
# Deployment paths: Azure's dated form, and what `AzureOpenAI(base_url=".../openai/v1")` sends.
AZURE_PREFIXES = ("/openai/deployments/", "/openai/v1/deployments/")
AZURE_BYTES = tuple(prefix.encode() for prefix in AZURE_PREFIXES)
MAX_DIRECT_ROUTES = 1024  # deployments' paths remembered; past it a handler is made for each request
# How uvicorn serves the gateway wherever it runs it (serve, demo, tests): httptools (gateway/server/protocol.py), no
# uvicorn access log (the gateway has its own), and
# neither proxy-headers middleware nor a server header, since nothing on the request path reads them.
SERVER_OPTIONS: dict[str, object] = {
    "http": "gateway.server.protocol:GatewayProtocol",  # httptools, with limits on heads and slow clients
    # The Responses API's WebSocket mode: uvicorn's wsproto protocol with the gateway's limit and shutdown. No
    # per-message compression: it costs CPU on every event, and the SSE path sends its events uncompressed too.
    "ws": "gateway.server.websocket:SocketProtocol",
    "ws_per_message_deflate": False,
    "lifespan": "on",
    "access_log": False,
    "proxy_headers": False,
    "server_header": False,
}


class Gateway:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.runtime: Runtime | None = None
        # Read by the WebSocket protocol (gateway/server/websocket.py) for each connection it opens.
        self.socket_message_limit = settings.responses.websocket.max_message_bytes
        # One list for both APIs' clients: OpenAI's fields and Anthropic's (type, display_name, created_at, the
        # page's first_id, last_id and has_more); each SDK reads its own and ignores the others.
        models = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "sluice",
                "type": "model",
                "display_name": name,
                "created_at": "1970-01-01T00:00:00Z",
            }
            for name in settings.models
        ]
        names = list(settings.models)
        page = {"has_more": False, "first_id": names[0] if names else None, "last_id": names[-1] if names else None}
        self.models_body = orjson.dumps({"object": "list", "data": models, **page})
        # The proxy routes' handlers for the protocol's direct path, once the runtime is up (until then the ASGI
        # app answers them): the fixed paths at start-up, a deployment's path when first asked for.
        self.direct_routes: dict[bytes, Handler] = {}
        errors_handled = {HTTPException: self.http_error}
        # /status, /metrics, /readyz's detail and the console: who sees them and where (server/admin.py).
        self.admin = Admin(settings, lambda: self.runtime, self._refused, self.healthz, errors_handled)
        routes = [
            Route("/healthz", self.healthz),
            Route("/readyz", self.admin.readyz),
            Route("/v1/models", self.list_models),
            Route("/models", self.list_models),
            Route("/openai/v1/models", self.list_models),
            # Claude Code's reachability check on its base URL (HEAD /api/hello), answered like Anthropic's API.
            Route("/api/hello", self.healthz, methods=["GET", "HEAD"]),
            *self.admin.routes(),
        ]
        self.site = Starlette(
            routes=routes,
            exception_handlers=errors_handled,  # type: ignore[arg-type]
            lifespan=self.lifespan,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self.socket(scope, receive, send)
            return
        if scope["type"] == "http":
            path: str = scope["path"]
            route = proxy_route(path)
            if route is not None:
                endpoint, deployment = route
                runtime = self.runtime
                if scope["method"] != "POST":
                    error: errors.GatewayError = errors.MethodNotAllowedError(f"{scope['method']} is not allowed here")
                    error.headers = [(b"allow", b"POST")]
                    rid = request_id(scope["headers"])
                    await send_error(send, error, rid)
                    self._refused(f"{scope['method']} {path}", error, rid)
                elif runtime is None:
                    error = errors.ServiceUnavailableError("gateway is starting")
                    await send_error(send, error, request_id(scope["headers"]))
                else:
                    await runtime.intake.asgi(runtime.intake.openai, scope, receive, send, endpoint, deployment)
                return
            messages = MESSAGE_PATHS.get(path)
            if messages is not None:
                await self.messages(scope, receive, send, messages)
                return
            jobs = path.startswith(JOB_PREFIX)
            if jobs or path.startswith(RESPONSE_PREFIXES):
                runtime = self.runtime
                rest = path[len(JOB_PREFIX) :] if jobs else path.partition("/responses/")[2]
                if runtime is None:
                    await send_error(send, errors.ServiceUnavailableError("gateway is starting"), "")
                else:
                    method: str = scope["method"]
                    query: bytes = scope.get("query_string", b"")
                    headers = scope["headers"]

                    def build(started: float, rid: str) -> Exchange:
                        return stored.exchange(headers, method, rest, query, jobs, started, rid)

                    await runtime.intake.built(scope, receive, send, f"{method} {path}", build)
                return
        await self.site(scope, receive, send)

    async def socket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A WebSocket: the Responses API's WebSocket mode on its paths; anywhere else a 404 before the upgrade."""
        runtime = self.runtime
        rid = request_id(scope["headers"])
        if runtime is None:
            await deny(send, errors.ServiceUnavailableError("gateway is starting"), rid)
        elif scope["path"] in SOCKET_PATHS:
            await runtime.sockets.serve(scope, receive, send)
        else:
            error = errors.NotFoundError("unknown URL", code="unknown_url")
            await deny(send, error, rid)
            self._refused(f"GET {scope['path']} (websocket)", error, rid)

    def direct_route(self, path: bytes) -> Handler | None:
        """The handler of a POST to `path` that the HTTP/1.1 protocol may run without ASGI (server/direct.py),
        or None: the request goes to the ASGI app (every other path, one with an escape to decode, and every
        path while the gateway is starting). The handler is the intake's own entry: no frame of the app's."""
        handler = self.direct_routes.get(path)
        runtime = self.runtime
        if handler is None and runtime is not None and path.startswith(AZURE_BYTES) and b"%" not in path:
            route = proxy_route(path.decode("latin-1")) if path.isascii() else None
            if route is not None:
                intake = runtime.intake
                handler = functools.partial(intake.direct, intake.openai, endpoint=route[0], path_model=route[1])
                if len(self.direct_routes) < MAX_DIRECT_ROUTES:
                    self.direct_routes[path] = handler
        return handler

    def _route_directly(self, runtime: Runtime) -> None:
        intake = runtime.intake
        for path, endpoint in ENDPOINTS.items():
            self.direct_routes[path.encode()] = functools.partial(intake.direct, intake.openai, endpoint=endpoint)
        door = runtime.messages.door  # Anthropic's Messages API (gateway/messages)
        for path, endpoint in MESSAGE_PATHS.items():
            self.direct_routes[path.encode()] = functools.partial(intake.direct, door, endpoint=endpoint)

    async def messages(self, scope: Scope, receive: Receive, send: Send, endpoint: str) -> None:
        """Anthropic's Messages API under ASGI: POST only, like every proxy route."""
        runtime = self.runtime
        if scope["method"] != "POST":
            error: errors.GatewayError = errors.MethodNotAllowedError(f"{scope['method']} is not allowed here")
            error.headers = [(b"allow", b"POST")]
            await send_error(send, error, request_id(scope["headers"]))
        elif runtime is None:
            await send_error(send, errors.ServiceUnavailableError("gateway is starting"), "")
        else:
            await runtime.intake.asgi(runtime.messages.door, scope, receive, send, endpoint)

    @contextlib.asynccontextmanager
    async def lifespan(self, _: Starlette) -> AsyncIterator[None]:
        runtime = Runtime(self.settings)
        await runtime.start()
        self.runtime = runtime
        self._route_directly(runtime)
        try:
            await self.admin.start()
            yield
        finally:
            self.runtime = None
            self.direct_routes.clear()
            await self.admin.aclose()
            await runtime.aclose()

    def _refused(self, what: str, error: errors.GatewayError, rid: str) -> None:
        """An access line for a request the app refused before the pipeline (a wrong method, an unknown URL)."""
        runtime = self.runtime
        if runtime is not None and runtime.pipeline.access is not None:
            refusal_line(runtime.pipeline.access, what, error, rid, time.perf_counter())

    async def healthz(self, _: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    async def list_models(self, _: Request) -> Response:
        return Response(self.models_body, media_type="application/json")

    async def http_error(self, request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 405:
            error: errors.GatewayError = errors.MethodNotAllowedError("method not allowed")
        elif exc.status_code == 404:
            error = errors.NotFoundError("unknown URL", code="unknown_url")
        else:
            error = errors.GatewayError(str(exc.detail), status=exc.status_code, type="invalid_request_error")
        rid = request_id(request.scope["headers"])
        headers = {**(exc.headers or {}), "x-request-id": rid}
        self._refused(f"{request.method} {request.url.path}", error, rid)
        return Response(error.body(), status_code=error.status, headers=headers, media_type="application/json")


def create_app(settings: Settings | None = None) -> Gateway:
    """The app for `settings`, else for the config found by `settings.load()` (used by uvicorn workers)."""
    if settings is None:
        # A worker of `sluice serve --workers N` (uvicorn imports the app in each): it exits with its supervisor.
        lifeline.arm()
        settings = load()
        if os.environ.get(handoff.ACCESS_LOG) == "1":  # `serve --workers N --access-log` sets it
            settings = settings.model_copy(update={"log": settings.log.model_copy(update={"access": True})})
        listen = os.environ.get(handoff.LISTEN, "")
        if listen:  # where the supervisor listens (`--host`, `--port`): what decides who sees the admin routes
            host, _, port = listen.rpartition(":")
            settings = settings.model_copy(update={"listen": Listen(host=host, port=int(port))})
    return Gateway(settings)


def proxy_route(path: str) -> tuple[str, str | None] | None:
    """(endpoint, deployment) for a proxy path, else None."""
    endpoint = ENDPOINTS.get(path)
    if endpoint is not None:
        return endpoint, None
    if path.startswith(AZURE_PREFIXES):
        prefix = AZURE_PREFIXES[0] if path.startswith(AZURE_PREFIXES[0]) else AZURE_PREFIXES[1]
        deployment, _, rest = path[len(prefix) :].partition("/")
        endpoint = ENDPOINTS.get("/" + rest) if deployment else None
        if endpoint is not None:
            return endpoint, deployment
    return None
