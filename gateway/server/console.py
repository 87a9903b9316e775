"""The latency console's routes: `/console` (one self-contained page) and the JSON it polls under `/console/api/`.

Served wherever the admin routes are, to whom they are: the app hands in its own access check. The page itself is
static (no data in it), so with `admin.token` set it is served to anyone who can reach the admin routes and asks
for the token, which it then sends as a bearer with every data request; those refuse a request without it.

Everything here runs off the request path, when the page asks: the ring (telemetry/console.py) is read, never
locked, and the proxy routes never wait on it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.telemetry import console

if TYPE_CHECKING:
    from gateway.runtime import Runtime

MAX_ROWS = 1000  # requests one list answer carries, newest first
MAX_MINUTES = 60.0
FILTERS = ("tenant", "model", "status", "door", "slow_ms", "id")  # what telemetry/console.py's `matches` reads
# The gauges the console shows beside /status: each model's SLO state, each endpoint in or out of service.
GAUGES = ("sluice_slo_state", "sluice_endpoint_up", "sluice_backend_loading")


def page() -> bytes:
    return resources.files("gateway.server").joinpath("console.html").read_bytes()


class Console:
    def __init__(
        self,
        runtime: Callable[[], Runtime | None],
        allowed: Callable[[Request], bool],
        unauthorized: Callable[[Request], Response],
        status: Callable[[Runtime], dict[str, Any]],
    ) -> None:
        self.runtime = runtime
        self.allowed = allowed
        self.unauthorized = unauthorized
        self.status = status  # what /status shows, which the state view extends
        self.html = page()  # read once: the page does not change while the gateway runs

    def routes(self) -> list[Route]:
        return [
            Route("/console", self.page),
            Route("/console/api/requests", self.guarded(self.requests)),
            Route("/console/api/requests/{rid:path}", self.guarded(self.request)),
            Route("/console/api/percentiles", self.guarded(self.percentiles)),
            Route("/console/api/state", self.guarded(self.state)),
        ]

    async def page(self, _: Request) -> Response:
        headers = {"cache-control": "no-store", "content-security-policy": CSP}
        return Response(self.html, media_type="text/html; charset=utf-8", headers=headers)

    def guarded(self, view: Callable[[Request, Runtime], Awaitable[Any]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            if not self.allowed(request):
                return self.unauthorized(request)
            runtime = self.runtime()
            if runtime is None or runtime.telemetry.ring is None:
                return _json({"error": "the console is off (admin.console.enabled) or the gateway is starting"}, 503)
            body = await view(request, runtime)
            return body if isinstance(body, Response) else _json(body)

        return endpoint

    async def requests(self, request: Request, runtime: Runtime) -> dict[str, Any]:
        query = request.query_params
        limit = min(_int(query.get("limit"), 200), MAX_ROWS)
        filters = {key: query[key] for key in FILTERS if query.get(key)}
        found = await runtime.telemetry.recent({"view": "requests", "filters": filters, "limit": limit})
        found.sort(key=lambda entry: entry[console.T], reverse=True)  # several workers' lists, merged
        ring = runtime.telemetry.ring
        assert ring is not None
        workers = "every worker" if runtime.telemetry.peers is not None else "this process"
        rows = [console.summary(entry) for entry in found[:limit]]
        return {"kept": len(ring), "capacity": ring.size, "from": workers, "requests": rows}

    async def request(self, request: Request, runtime: Runtime) -> Any:
        rid = request.path_params["rid"]
        found = await runtime.telemetry.recent({"view": "request", "id": rid})
        if found:
            return console.waterfall(max(found, key=lambda entry: entry[console.T]))
        ring = runtime.telemetry.ring
        assert ring is not None
        return _json({"error": f"request {rid} is not among the last {ring.size} requests"}, 404)

    async def percentiles(self, request: Request, runtime: Runtime) -> dict[str, Any]:
        minutes = min(max(_float(request.query_params.get("minutes"), 5.0), 0.1), MAX_MINUTES)
        since = time.time() - minutes * 60.0
        step = max(minutes * 60.0 / 30.0, 1.0)  # thirty points on the chart
        entries = await runtime.telemetry.recent({"view": "window", "since": since})
        return await asyncio.to_thread(window, entries, since, step)  # the loop serves requests meanwhile

    async def state(self, _: Request, runtime: Runtime) -> dict[str, Any]:
        return self._state(runtime)

    def _state(self, runtime: Runtime) -> dict[str, Any]:
        gauges: dict[str, list[dict[str, Any]]] = {name: [] for name in GAUGES}
        for family in runtime.telemetry.metrics.registry.collect():
            if family.name in gauges:
                gauges[family.name] = [{**s.labels, "value": s.value} for s in family.samples]
        slo = {
            sample["model"]: sample["state"] for sample in gauges["sluice_slo_state"] if sample["value"] > 0
        }  # the state each model is in (1), of the states it has been in (0)
        return {**self.status(runtime), "slo": slo, "endpoints": gauges["sluice_endpoint_up"]}


# The page's own policy: its inline script and style only, data from this origin, nothing from elsewhere.
CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src data:"


def window(entries: list[console.Entry], since: float, step: float) -> dict[str, Any]:
    return {**console.percentiles(entries, since, step), "shares": console.shares(entries, since)}


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _int(text: str | None, default: int) -> int:
    try:
        return max(1, int(text)) if text else default
    except ValueError:
        return default


def _float(text: str | None, default: float) -> float:
    try:
        value = float(text) if text else default
    except ValueError:
        return default
    return value if value == value else default  # NaN
