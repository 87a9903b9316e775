"""The client's and the server's addresses: looked up when something reads them, not for every connection."""

from __future__ import annotations

import inspect
import json
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from gateway.server.address import UNKNOWN
from gateway.server.protocol import GatewayProtocol
from tests.support.gateway import serve_in_thread
from tools.bench.fleet import free_port


async def echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An ASGI app answering with the scope's addresses (the app has no direct routes: every request is ASGI)."""
    if scope["type"] != "http":
        return
    body = json.dumps({"client": scope["client"], "server": scope["server"]}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture()
def server() -> Iterator[uvicorn.Server]:
    config = uvicorn.Config(
        echo, host="127.0.0.1", port=free_port(), loop="none", lifespan="off", http=GatewayProtocol, log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = serve_in_thread(server)
    deadline = time.monotonic() + 10.0
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(10)


def connection(server: uvicorn.Server) -> GatewayProtocol:
    deadline = time.monotonic() + 5.0
    while not server.server_state.connections:
        assert time.monotonic() < deadline, "no connection made"
        time.sleep(0.01)
    (made,) = server.server_state.connections
    assert isinstance(made, GatewayProtocol)
    return made


def test_addresses_are_looked_up_when_read(server: uvicorn.Server) -> None:
    with socket.create_connection(("127.0.0.1", server.config.port), timeout=5.0) as client:
        protocol = connection(server)
        # The connection is made and nothing has read its addresses: neither was looked up (nor set as uvicorn's
        # connection_made sets them).
        for name in ("client", "server"):
            assert vars(protocol).get(f"_{name}", UNKNOWN) is UNKNOWN, name
            assert vars(protocol).get(name) is None, name
        client.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        found = json.loads(body)
        assert tuple(found["client"]) == client.getsockname()
        assert tuple(found["server"]) == client.getpeername()


def test_uvicorns_connection_made_sets_what_ours_does() -> None:
    """Ours is uvicorn's without the eager look-ups: a uvicorn that sets something more needs it copied."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    theirs = set(re.findall(r"self\.(\w+) = ", inspect.getsource(HttpToolsProtocol.connection_made)))
    assert theirs == {"transport", "flow", "server", "client", "scheme"}
    ours = set(re.findall(r"self\.(\w+) = ", inspect.getsource(GatewayProtocol.connection_made)))
    assert theirs - {"server", "client"} <= ours
