"""The admin surface decided at start-up: who sees /status and /metrics, where; and the answers before the
runtime is up."""

from __future__ import annotations

import orjson
import pytest
from starlette.requests import Request
from starlette.responses import Response

from gateway import errors
from gateway.config import parse
from gateway.server.admin import Admin, loopback

BASE = "backends: {sim: {type: simulated}}\nmodels: {m: {backend: sim}}\n"


def admin(extra: str = "", refused: list[str] | None = None) -> Admin:
    def note(what: str, error: errors.GatewayError, rid: str) -> None:
        if refused is not None:
            refused.append(f"{what} {error.status}")

    async def healthz(_: Request) -> Response:
        return Response(b"ok")

    return Admin(parse(BASE + extra), lambda: None, note, healthz, {})


def request(path: str, token: str | None = None) -> Request:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token is not None else []
    return Request({"type": "http", "method": "GET", "path": path, "headers": headers, "query_string": b""})


@pytest.mark.parametrize(
    ("host", "expected"),
    [("127.0.0.1", True), ("::1", True), ("localhost", True), ("0.0.0.0", False), ("10.0.0.1", False), ("gw", False)],
)
def test_loopback(host: str, expected: bool) -> None:
    assert loopback(host) is expected


def test_on_a_loopback_port_the_routes_are_open_there() -> None:
    surface = admin("listen: {host: 127.0.0.1, port: 8080}\n")
    assert surface.here
    assert surface.site is None
    assert {getattr(r, "path", "") for r in surface.routes()} >= {"/status", "/metrics"}
    assert surface.allowed(request("/status"))


def test_on_a_public_port_without_a_token_they_are_not_served() -> None:
    surface = admin("listen: {host: 0.0.0.0, port: 8080}\n")
    assert not surface.here
    assert surface.routes() == []


def test_a_token_guards_them_on_a_public_port() -> None:
    refused: list[str] = []
    surface = admin("listen: {host: 0.0.0.0, port: 8080}\nadmin: {token: s3cret}\n", refused)
    assert surface.here
    assert surface.allowed(request("/status", "s3cret"))
    assert not surface.allowed(request("/status", "wrong"))
    assert not surface.allowed(request("/status"))
    answer = surface.unauthorized(request("/metrics"))
    assert answer.status_code == 401
    assert answer.headers["www-authenticate"] == "Bearer"
    assert orjson.loads(answer.body)["error"]["code"] == "invalid_admin_token"
    assert refused == ["GET /metrics 401"]  # the app's access line for it


def test_an_admin_port_takes_them_off_the_tenants_port() -> None:
    surface = admin("listen: {host: 127.0.0.1, port: 8080}\nadmin: {port: 9090}\n")
    assert not surface.here
    assert surface.routes() == []
    assert surface.site is not None


async def test_before_the_runtime_is_up_they_say_starting() -> None:
    surface = admin("listen: {host: 127.0.0.1, port: 8080}\n")
    ready = await surface.readyz(request("/readyz"))
    assert (ready.status_code, ready.body) == (503, b'{"status":"starting"}')
    status = await surface.status(request("/status"))
    assert orjson.loads(status.body) == {"status": "starting"}
    metrics = await surface.metrics(request("/metrics"))
    assert metrics.status_code == 503
