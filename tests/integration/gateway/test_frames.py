"""The coroutine frames a request holds while it waits for its upstream's head: at most ten.

Every frame between the protocol and the pool is one a waiting request keeps alive and one its answer passes
back through; a frame that only hands a request on is a cost on every request and a place for the transport to
leak into the control flow. The gateway runs under uvicorn in this test's own event loop (so that its tasks can
be read), with an upstream that takes the request and holds its answer until the frames are counted.
"""

from __future__ import annotations

import asyncio
import types
from typing import Any

import httpx
import uvicorn

from gateway.app import SERVER_OPTIONS, create_app
from gateway.config import parse
from tests.support.gateway import free_port

MOST_FRAMES = 10
ANSWER = b'{"id":"c1","object":"chat.completion","choices":[]}'


def chain(task: asyncio.Task[Any]) -> list[str]:
    """The qualified names of the coroutines a task is awaiting, outermost first."""
    names = []
    coro: Any = task.get_coro()
    while isinstance(coro, types.CoroutineType):
        names.append(coro.cr_code.co_qualname)
        coro = coro.cr_await
    return names


async def held_upstream(received: asyncio.Event, release: asyncio.Event) -> asyncio.Server:
    """An upstream that reads a request, says so, and answers only once released."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                await reader.readexactly(length)
                received.set()
                await release.wait()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                    % (len(ANSWER), ANSWER)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def count() -> list[str]:
    received, release = asyncio.Event(), asyncio.Event()
    upstream = await held_upstream(received, release)
    upstream_port = upstream.sockets[0].getsockname()[1]
    config = f"""
backends:
  up: {{type: openai, api_key: sk-test, base_url: "http://127.0.0.1:{upstream_port}/v1"}}
pool: {{warm_connections: 0}}
models:
  chat: {{backend: up}}
"""
    port = free_port()
    options: dict[str, Any] = {**SERVER_OPTIONS, "host": "127.0.0.1", "port": port, "log_level": "warning"}
    server = uvicorn.Server(uvicorn.Config(create_app(parse(config, "test")), **options))
    serving = asyncio.create_task(server.serve())
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            deadline = asyncio.get_running_loop().time() + 60
            while not server.started:  # uvicorn offers no event to wait on
                assert asyncio.get_running_loop().time() < deadline, "the gateway did not start"
                await asyncio.sleep(0.02)
            body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
            sent = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            await asyncio.wait_for(received.wait(), 30)
            await asyncio.sleep(0)  # the request's task is parked on the head it waits for
            waiting = [names for task in asyncio.all_tasks() if "Pool._exchange" in (names := chain(task))]
            release.set()
            response = await asyncio.wait_for(sent, 30)
            assert response.status_code == 200
            assert response.content == ANSWER
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 30)
        upstream.close()
    assert len(waiting) == 1, waiting
    return waiting[0]


def test_a_request_waiting_for_its_upstream_holds_at_most_ten_frames() -> None:
    frames = asyncio.run(count())
    assert frames[0] == "Reader.serve"  # the reader's task for the connection's requests
    assert frames[-1] == "Pool._exchange"
    assert len(frames) <= MOST_FRAMES, " -> ".join(frames)
