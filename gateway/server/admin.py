"""The admin listener: `/status`, `/metrics` and `/readyz` with its detail on a port of their own.

Served by the same HTTP/1.1 protocol as the tenants' port (its limits on heads and slow clients) from a
socket this process opens once its runtime has started; the workers of `sluice serve --workers N` each open
it with SO_REUSEPORT, so the kernel spreads scrapes over them as it spreads requests on the main port. The
gateway's `Gateway` decides what the routes answer; this module only listens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn
from starlette.types import ASGIApp
from uvicorn.server import ServerState

from gateway.server.protocol import GatewayProtocol

log = logging.getLogger("sluice")


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
