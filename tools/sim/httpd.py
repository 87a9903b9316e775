"""The HTTP side of the stand-ins: a request/response pair over ASGI, and one uvicorn serving every replica.

The stand-ins (`sim_vllm`, `sim_tgi`, `sim_llamacpp`, `sim_ollama`) model slow servers, so they trade the raw
protocol of `tools.sim` for plain handlers: `async (Request) -> Response`. A streamed body is an async
iterator of byte strings; a client that disconnects cancels it, so a replica frees its batch slot the way vLLM
aborts a request whose client left; a client that leaves before a whole (non-streamed) answer is ready
cancels its handler the same way. Replicas share one uvicorn server (one event loop), each on its own
socket, and are told apart by the local port a request arrived on.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@dataclass(slots=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        """The body as JSON; raises ValueError when it is not."""
        return orjson.loads(self.body)


@dataclass(slots=True)
class Response:
    status: int
    body: bytes | AsyncIterator[bytes] = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


def json_response(status: int, document: object, headers: dict[str, str] | None = None) -> Response:
    return Response(status, orjson.dumps(document), headers=headers or {})


Handler = Callable[[Request], Awaitable[Response]]


def asgi(handler: Handler, replica: int) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """An ASGI app answering with `handler`; every response names the replica in `x-sim-replica`."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        request = Request(scope["method"], scope["path"], headers, b"".join(chunks))
        gone = asyncio.Event()
        watcher = asyncio.ensure_future(_watch(receive, gone))
        try:
            response = await _unless_gone(handler(request), gone)
            if response is not None:
                await _send(response, replica, send, gone)
        finally:
            watcher.cancel()

    return app


async def _watch(receive: Receive, gone: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def _unless_gone(answer: Awaitable[Response], gone: asyncio.Event) -> Response | None:
    """The handler's response, or None if the client left first (the handler is then cancelled)."""
    task = asyncio.ensure_future(answer)
    waiter = asyncio.ensure_future(gone.wait())
    try:
        await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, waiter, return_exceptions=True)
    return task.result() if not task.cancelled() else None


async def _send(response: Response, replica: int, send: Send, gone: asyncio.Event) -> None:
    head = [(b"content-type", response.content_type.encode()), (b"x-sim-replica", b"%d" % replica)]
    head += [(name.encode(), value.encode("latin-1")) for name, value in response.headers.items()]
    if isinstance(response.body, bytes):
        head.append((b"content-length", b"%d" % len(response.body)))
        await send({"type": "http.response.start", "status": response.status, "headers": head})
        await send({"type": "http.response.body", "body": response.body})
        return
    head.append((b"cache-control", b"no-cache"))
    await send({"type": "http.response.start", "status": response.status, "headers": head})
    await _stream(response.body, send, gone)


async def _stream(body: AsyncIterator[bytes], send: Send, gone: asyncio.Event) -> None:
    """Send `body` piece by piece; a disconnect cancels it (its `finally` blocks release what it holds)."""

    async def pump() -> None:
        async for piece in body:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    writer = asyncio.ensure_future(pump())
    waiter = asyncio.ensure_future(gone.wait())
    try:
        await asyncio.wait((writer, waiter), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (writer, waiter):
            task.cancel()
        failed, _ = await asyncio.gather(writer, waiter, return_exceptions=True)
        aclose = getattr(body, "aclose", None)
        if aclose is not None:
            await aclose()
    if isinstance(failed, Exception):
        raise failed


def bind(host: str, port: int) -> socket.socket:
    """A bound socket that does not listen yet: a connection to it is refused until `serve` starts."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def server(apps: dict[int, Callable[[Scope, Receive, Send], Awaitable[None]]]) -> uvicorn.Server:
    """One uvicorn server for several replicas, each picked by the local port a request arrived on."""

    async def dispatch(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await apps[scope["server"][1]](scope, receive, send)

    config = uvicorn.Config(
        dispatch,
        loop="none",
        http="httptools",
        lifespan="off",
        timeout_graceful_shutdown=2,  # a stream left open does not hold up the exit
        access_log=False,
        log_level="warning",
        server_header=False,
        date_header=False,
    )
    return uvicorn.Server(config)
