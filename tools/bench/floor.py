"""The least a Python reverse proxy does: the yardstick for the gateway's CPU per request (`sluice bench`, core).

`python -m tools.bench.floor --port P --upstream http://127.0.0.1:U`: uvloop and httptools, as the gateway. A
client's request is framed by the parser and its bytes, as read, written to a keep-alive upstream connection
taken from a pool (opened when none is idle); the answer's bytes go back to the client as they are read, and
the upstream's parser finds the answer's end, which returns the connection to the pool. No routing, no header
rewritten or checked, no timeout, no error of its own, no pipelining: whatever a Python proxy does on top of
this costs more, so the gateway's cost per request over this one's is what its features cost over Python's
floor.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from typing import cast
from urllib.parse import urlsplit

import httptools
import uvloop


class Upstream(asyncio.Protocol):
    """A keep-alive connection to the upstream, lent to one client's request at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set by connection_made
        self.client: Client | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of asyncio's

    def data_received(self, data: bytes) -> None:
        if self.client is not None:
            self.client.transport.write(data)
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        self.client = None
        self.pool.idle.append(self)

    def connection_lost(self, exc: Exception | None) -> None:
        with contextlib.suppress(ValueError):
            self.pool.idle.remove(self)
        if self.client is not None:
            self.client.transport.close()


class Pool:
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.idle: list[Upstream] = []

    async def send(self, client: Client, request: bytes) -> None:
        """`request` on an idle connection, or on one opened for it."""
        if self.idle:
            upstream = self.idle.pop()
        else:
            try:
                _, upstream = await asyncio.get_running_loop().create_connection(
                    lambda: Upstream(self), self.host, self.port
                )
            except OSError:
                client.transport.close()
                return
        upstream.client = client
        upstream.transport.write(request)


class Client(asyncio.Protocol):
    """One client connection: each request's bytes, once the parser has seen its end, go to a pooled connection."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set by connection_made
        self.parts: list[bytes] = []  # the current request's bytes
        self.ended = False  # the parser saw the current request's end

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.parts.append(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()
            return
        if self.ended:
            request = b"".join(self.parts) if len(self.parts) > 1 else data
            self.parts = []
            self.ended = False
            if self.pool.idle:
                upstream = self.pool.idle.pop()
                upstream.client = self
                upstream.transport.write(request)
            else:
                asyncio.get_running_loop().create_task(self.pool.send(self, request))

    def on_message_complete(self) -> None:
        self.ended = True


async def serve(port: int, upstream: str) -> None:
    target = urlsplit(upstream)
    pool = Pool(target.hostname or "127.0.0.1", target.port or 80)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Client(pool), "127.0.0.1", port, backlog=1024)
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with server:
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the upstream's URL, e.g. http://127.0.0.1:9000")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(args.port, args.upstream))


if __name__ == "__main__":
    main()
