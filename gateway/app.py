"""The ASGI application: a bare callable for the proxy endpoints, Starlette for everything else.

The proxy paths are matched with one dict lookup and go straight to the pipeline, without routing,
middleware or Request objects; health, readiness, the model list and unknown paths go through
Starlette, where per-request cost does not matter.
"""

from __future__ import annotations

import contextlib
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

from gateway import errors
from gateway.config import load
from gateway.pipeline import refusal_line
from gateway.responses.api import JOB_PREFIX
from gateway.responses.api import PREFIXES as RESPONSE_PREFIXES
from gateway.runtime import Runtime
from gateway.server import lifeline
from gateway.server.reply import send_error
from gateway.server.request import request_id
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
    # Azure OpenAI's v1 form, which `AzureOpenAI` and `OpenAI(base_url=".../openai/v1")` use.
    "/openai/v1/chat/completions": "chat/completions",
    "/openai/v1/completions": "completions",
    "/openai/v1/embeddings": "embeddings",
    "/openai/v1/responses": "responses",
    "/responses": "responses",
}
# Deployment paths: Azure's dated form, and what `AzureOpenAI(base_url=".../openai/v1")` sends.
AZURE_PREFIXES = ("/openai/deployments/", "/openai/v1/deployments/")
# How uvicorn serves the gateway wherever it runs it (serve, demo, tests): httptools (gateway/server/protocol.py), no
# uvicorn access log (the gateway has its own), and
# neither proxy-headers middleware nor a server header, since nothing on the request path reads them.
SERVER_OPTIONS: dict[str, object] = {
    "http": "gateway.server.protocol:GatewayProtocol",  # httptools, with limits on heads and slow clients
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
                Route("/status", self.status),
                Route("/v1/models", self.list_models),
                Route("/models", self.list_models),
                Route("/openai/v1/models", self.list_models),
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
            if endpoint is None and path.startswith(AZURE_PREFIXES):
                prefix = AZURE_PREFIXES[0] if path.startswith(AZURE_PREFIXES[0]) else AZURE_PREFIXES[1]
                deployment, _, rest = path[len(prefix) :].partition("/")
                endpoint = ENDPOINTS.get("/" + rest) if deployment else None
            if endpoint is not None:
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

    def _refused(self, what: str, error: errors.GatewayError, rid: str) -> None:
        """An access line for a request the app refused before the pipeline (a wrong method, an unknown URL)."""
        runtime = self.runtime
        if runtime is not None and runtime.pipeline.access is not None:
            refusal_line(runtime.pipeline.access, what, error, rid, time.perf_counter())

    async def healthz(self, _: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    async def readyz(self, _: Request) -> Response:
        """200 once every backend's warm-up was attempted and the plugins have started; never on upstreams' health."""
        runtime = self.runtime
        if runtime is None:
            return Response(b'{"status":"starting"}', status_code=503, media_type="application/json")
        return Response(
            orjson.dumps(runtime.status()), status_code=200 if runtime.ready else 503, media_type="application/json"
        )

    async def status(self, _: Request) -> Response:
        """The gateway's state for people and scripts: backends (state, warm connections, last error), Redis."""
        runtime = self.runtime
        body = runtime.status() if runtime is not None else {"status": "starting"}
        return Response(orjson.dumps(body, option=orjson.OPT_INDENT_2), media_type="application/json")

    async def list_models(self, _: Request) -> Response:
        return Response(self.models_body, media_type="application/json")

    async def metrics(self, request: Request) -> Response:
        runtime = self.runtime
        if runtime is None:
            return Response(b"gateway is starting\n", status_code=503, media_type="text/plain")
        body, content_type = await runtime.telemetry.exposition(request.headers.get("accept", ""))
        return Response(body, headers={"content-type": content_type})

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
        if os.environ.get("SLUICE_ACCESS_LOG") == "1":  # `serve --workers N --access-log` sets it
            settings = settings.model_copy(update={"log": settings.log.model_copy(update={"access": True})})
    return Gateway(settings)
