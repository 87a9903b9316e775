"""The ASGI application: a bare callable for the proxy endpoints, Starlette for everything else.

The proxy paths are matched with one dict lookup and go straight to the pipeline, without routing,
middleware or Request objects; health, readiness, the model list and unknown paths go through
Starlette, where per-request cost does not matter.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway import errors
from gateway.config import load
from gateway.pipeline import send_error
from gateway.responses import JOB_PREFIX
from gateway.responses import PREFIXES as RESPONSE_PREFIXES
from gateway.runtime import Runtime
from gateway.settings import Settings

ENDPOINTS = {
    "/v1/chat/completions": "chat/completions",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
    # The same paths without /v1, as some clients are configured with the bare host as base URL.
    "/chat/completions": "chat/completions",
    "/completions": "completions",
    "/embeddings": "embeddings",
    "/responses": "responses",
}
AZURE_PREFIX = "/openai/deployments/"
# How uvicorn serves the gateway wherever it runs it (serve, demo, tests): httptools, no access log, and
# neither proxy-headers middleware nor a server header, since nothing on the request path reads them.
SERVER_OPTIONS: dict[str, object] = {
    "http": "httptools",
    "lifespan": "on",
    "access_log": False,
    "proxy_headers": False,
    "server_header": False,
}


class Gateway:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.runtime: Runtime | None = None
        models = [{"id": name, "object": "model", "created": 0, "owned_by": "sluice"} for name in settings.models]
        self.models_body = orjson.dumps({"object": "list", "data": models})
        self.site = Starlette(
            routes=[
                Route("/healthz", self.healthz),
                Route("/readyz", self.readyz),
                Route("/v1/models", self.list_models),
                Route("/models", self.list_models),
                Route("/metrics", self.metrics),
            ],
            exception_handlers={HTTPException: self.http_error},  # type: ignore[dict-item]
            lifespan=self.lifespan,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            endpoint = ENDPOINTS.get(path)
            deployment = None
            if endpoint is None and path.startswith(AZURE_PREFIX):
                deployment, _, rest = path[len(AZURE_PREFIX) :].partition("/")
                endpoint = ENDPOINTS.get("/" + rest) if deployment else None
            if endpoint is not None:
                runtime = self.runtime
                if scope["method"] != "POST":
                    error: errors.GatewayError = errors.MethodNotAllowedError(f"{scope['method']} is not allowed here")
                    error.headers = [(b"allow", b"POST")]
                    await send_error(send, error, "")
                elif runtime is None:
                    await send_error(send, errors.ServiceUnavailableError("gateway is starting"), "")
                else:
                    await runtime.pipeline.handle(scope, receive, send, endpoint, deployment)
                return
            jobs = path.startswith(JOB_PREFIX)
            if jobs or path.startswith(RESPONSE_PREFIXES):
                runtime = self.runtime
                rest = path[len(JOB_PREFIX) :] if jobs else path.partition("/responses/")[2]
                if runtime is None:
                    await send_error(send, errors.ServiceUnavailableError("gateway is starting"), "")
                else:
                    await runtime.responses.handle(scope, receive, send, rest, jobs)
                return
        await self.site(scope, receive, send)

    @contextlib.asynccontextmanager
    async def lifespan(self, _: Starlette) -> AsyncIterator[None]:
        runtime = Runtime(self.settings)
        await runtime.start()
        self.runtime = runtime
        try:
            yield
        finally:
            self.runtime = None
            await runtime.aclose()

    async def healthz(self, _: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    async def readyz(self, _: Request) -> Response:
        ready = self.runtime is not None and self.runtime.ready
        body = b'{"status":"ready"}' if ready else b'{"status":"warming"}'
        return Response(body, status_code=200 if ready else 503, media_type="application/json")

    async def list_models(self, _: Request) -> Response:
        return Response(self.models_body, media_type="application/json")

    async def metrics(self, request: Request) -> Response:
        runtime = self.runtime
        if runtime is None:
            return Response(b"gateway is starting\n", status_code=503, media_type="text/plain")
        body, content_type = runtime.telemetry.exposition(request.headers.get("accept", ""))
        return Response(body, headers={"content-type": content_type})

    async def http_error(self, _: Request, exc: HTTPException) -> Response:
        if exc.status_code == 405:
            error: errors.GatewayError = errors.MethodNotAllowedError("method not allowed")
        elif exc.status_code == 404:
            error = errors.NotFoundError("unknown URL", code="unknown_url")
        else:
            error = errors.GatewayError(str(exc.detail), status=exc.status_code, type="invalid_request_error")
        return Response(error.body(), status_code=error.status, headers=exc.headers, media_type="application/json")


def create_app(settings: Settings | None = None) -> Gateway:
    """The app for `settings`, else for the config found by `settings.load()` (used by uvicorn workers)."""
    return Gateway(settings if settings is not None else load())
