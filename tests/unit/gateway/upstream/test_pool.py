"""The upstream connection pool against real loopback servers: framing, reuse, limits, timeouts, failures."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import resource
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any, TypeVar

import pytest

from gateway.upstream.connection import (
    HIGH_WATER,
    ConnectError,
    ConnectTimeout,
    DescriptorsExhausted,
    PoolTimeout,
    ReadTimeout,
    RemoteProtocolError,
    Response,
    ResponseClosed,
)
from gateway.upstream.pool import Pool, PoolLimits
from tests.support.upstream import (
    MalformedChunk,
    Ok,
    Raw,
    ResetBeforeHeaders,
    ResetMidStream,
    ScriptedUpstream,
    Stall,
    Status,
)
from tests.support.wait import until

# Short timeouts so that a hang fails fast instead of stalling the run.
FAST = PoolLimits(
    warm=0, connect_timeout=1.0, pool_timeout=1.0, first_byte_timeout=2.0, idle_read_timeout=2.0, keepalive_expiry=30
)
CHAT = "/v1/chat/completions"

MakePool = Callable[..., Pool]
T = TypeVar("T")


@pytest.fixture()
def up() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream() as upstream:
        yield upstream


def pool_factory(up: ScriptedUpstream, pools: list[Pool]) -> MakePool:
    def make(url: str | None = None, **limits: Any) -> Pool:
        pool = Pool(url or up.url, replace(FAST, **limits))
        pools.append(pool)
        return pool

    return make


@pytest.fixture()
async def make_pool(up: ScriptedUpstream) -> AsyncIterator[MakePool]:
    pools: list[Pool] = []
    yield pool_factory(up, pools)
    for pool in pools:
        await pool.aclose()


async def chat(pool: Pool, stream: bool = False, target: str = CHAT) -> Response:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi there"}], "stream": stream})
    return await pool.request(b"POST", target.encode(), b"content-type: application/json\r\n", body.encode())


async def within(awaitable: Awaitable[T], seconds: float = 1.0) -> T:
    """Await with a bound, so that a timer the pool failed to set fails the test instead of hanging it."""
    return await asyncio.wait_for(awaitable, seconds)


async def read_on(response: Response, chunks: list[bytes], stamps: list[float] | None = None) -> None:
    """Read the body chunk by chunk until it fails, keeping what came (and when) for the test to check."""
    while True:
        chunks.append(await within(response.next_chunk()))
        if stamps is not None:
            stamps.append(time.monotonic())


async def disconnected(up: ScriptedUpstream, count: int = 1) -> bool:
    return await asyncio.to_thread(up.wait_disconnect, 2.0, count)


def sse_data(body: bytes) -> list[str]:
    return [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_whole_response_with_content_length(up: ScriptedUpstream, make_pool: MakePool) -> None:
    up.script(Status(200, {"answer": 42}, {"x-extra": "yes"}))
    pool = make_pool()
    response = await chat(pool)
    headers = dict(response.headers)
    body = await response.read()
    assert response.status == 200
    assert headers[b"x-extra"] == b"yes"
    assert headers[b"content-length"] == str(len(body)).encode()
    assert json.loads(body) == {"answer": 42}
    assert response.complete
    sent = up.requests[0]
    assert (sent.method, sent.path, sent.headers["host"]) == ("POST", CHAT, f"127.0.0.1:{up.port}")
    assert sent.headers["content-length"] == str(len(sent.body))
    assert sent.json["messages"][0]["content"] == "hi there"

    response = await chat(pool)
    completion = json.loads(await response.read())
    assert completion["object"] == "chat.completion"
    assert completion["usage"]["completion_tokens"] == 5


async def test_stream_chunks_arrive_as_they_are_sent(up: ScriptedUpstream, make_pool: MakePool) -> None:
    up.script(Ok(ttft_ms=200, tpot_ms=60, tokens=4))
    response = await chat(make_pool(), stream=True)
    head_at = time.monotonic()
    arrivals: list[tuple[float, bytes]] = []
    while chunk := await response.next_chunk():
        arrivals.append((time.monotonic(), chunk))
    assert arrivals[0][0] - head_at > 0.1, "request() returns with the head, before the first token"

    def arrival(token: str) -> float:
        return next(at for at, chunk in arrivals if token.encode() in chunk)

    # 180 ms between the first and the last token at the upstream; a buffering pool would deliver them together.
    assert arrival("tok3") - arrival("tok0") > 0.1
    assert arrival("tok0") < arrival("tok1") < arrival("tok3")
    data = sse_data(b"".join(chunk for _, chunk in arrivals))
    assert data[-1] == "[DONE]"
    deltas = [json.loads(item)["choices"][0]["delta"] for item in data[:-1]]
    assert deltas[0]["role"] == "assistant"
    assert "".join(delta.get("content", "") for delta in deltas) == "tok0 tok1 tok2 tok3"
    assert response.complete


async def test_sequential_requests_reuse_one_connection(up: ScriptedUpstream, make_pool: MakePool) -> None:
    pool = make_pool()
    for i in range(10):
        response = await chat(pool, stream=i % 2 == 0)
        assert response.status == 200
        assert await response.read()
    assert up.connections_opened == 1
    assert {request.connection for request in up.requests} == {1}
    assert (pool.size, pool.idle) == (1, 1)


async def test_warm_opens_connections_before_any_request(up: ScriptedUpstream, make_pool: MakePool) -> None:
    pool = make_pool(warm=2)
    assert await pool.warm(4) == 4
    await until(lambda: up.connections_opened == 4)
    assert up.requests == []
    assert await pool.warm() == 4, "already warm: nothing more to open"

    up.default = Ok(ttft_ms=50)
    responses = await asyncio.gather(*(chat(pool) for _ in range(4)))
    for response in responses:
        assert await response.read()
    assert up.connections_opened == 4
    assert {request.connection for request in up.requests} == {1, 2, 3, 4}


async def test_warm_stays_within_max_connections(up: ScriptedUpstream, make_pool: MakePool) -> None:
    pool = make_pool(max_connections=2)
    assert await pool.warm(4) == 2
    assert pool.size == 2


async def test_max_connections_queues_requests_until_one_is_free(up: ScriptedUpstream, make_pool: MakePool) -> None:
    up.default = Ok(ttft_ms=100)
    pool = make_pool(max_connections=2)

    async def one() -> bytes:
        response = await chat(pool)
        assert pool.size <= 2
        return await response.read()

    started = time.monotonic()
    bodies = await asyncio.gather(*(one() for _ in range(6)))
    assert all(json.loads(body)["object"] == "chat.completion" for body in bodies)
    assert time.monotonic() - started > 0.28, "three rounds of two"
    assert up.connections_opened == 2


async def test_pool_timeout_when_every_connection_is_busy(up: ScriptedUpstream, make_pool: MakePool) -> None:
    up.script(Stall(after_chunks=1))
    pool = make_pool(max_connections=1, pool_timeout=0.1)
    busy = await chat(pool, stream=True)
    started = time.monotonic()
    with pytest.raises(PoolTimeout):
        await within(chat(pool))
    assert 0.08 < time.monotonic() - started < 0.5
    busy.close()


async def test_waiter_gets_a_new_connection_when_the_busy_one_is_closed(
    up: ScriptedUpstream, make_pool: MakePool
) -> None:
    up.script(Stall(after_chunks=1))
    pool = make_pool(max_connections=1)
    busy = await chat(pool, stream=True)
    waiting = asyncio.create_task(chat(pool))
    await until(lambda: len(pool._waiters) == 1)
    assert not waiting.done()
    busy.close()
    response = await asyncio.wait_for(waiting, 0.5)
    assert json.loads(await response.read())["object"] == "chat.completion"
    assert up.connections_opened == 2


async def test_a_freed_slot_goes_to_one_waiter_only(up: ScriptedUpstream, make_pool: MakePool) -> None:
    up.script(Stall(after_chunks=1), Stall(after_chunks=1))
    pool = make_pool(max_connections=1)
    busy = await chat(pool, stream=True)
    second = asyncio.create_task(chat(pool, stream=True))
    third = asyncio.create_task(chat(pool))
    await until(lambda: len(pool._waiters) == 2)
    busy.close()
    response = await asyncio.wait_for(second, 0.5)
    await asyncio.sleep(0.1)  # not a wait for a condition: time for a wrong second hand-over to show
    assert not third.done(), "the slot freed by one connection was handed out twice"
    assert pool.size == 1
    response.close()
    assert await (await asyncio.wait_for(third, 0.5)).read()
    assert up.connections_opened == 3


async def test_a_cancelled_waiter_does_not_lose_the_freed_slot(up: ScriptedUpstream, make_pool: MakePool) -> None:
    up.script(Stall(after_chunks=1))
    pool = make_pool(max_connections=1, pool_timeout=2.0)
    busy = await chat(pool, stream=True)
    cancelled = asyncio.create_task(chat(pool))
    waiting = asyncio.create_task(chat(pool))
    await until(lambda: len(pool._waiters) == 2)
    cancelled.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await cancelled
    busy.close()
    response = await asyncio.wait_for(waiting, 0.5)
    assert await response.read()


async def test_connection_refused_is_a_connect_error(make_pool: MakePool) -> None:
    pool = make_pool(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ConnectError) as caught:
        await chat(pool)
    assert not isinstance(caught.value, ConnectTimeout)
    with pytest.raises(ConnectError):  # a warm-up that opens nothing says why
        await pool.warm(2)
    assert pool.size == 0


async def test_upstream_that_closes_at_once_fails_fast(make_pool: MakePool) -> None:
    class Slam(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            transport.close()

    server = await asyncio.get_running_loop().create_server(Slam, "127.0.0.1", 0)
    pool = make_pool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        for _ in range(5):
            started = time.monotonic()
            with pytest.raises((ConnectError, RemoteProtocolError)):
                await within(chat(pool))
            assert time.monotonic() - started < 0.5
            assert pool.size == 0
    finally:
        server.close()
        await server.wait_closed()


async def test_first_byte_timeout_closes_the_connection(up: ScriptedUpstream, make_pool: MakePool) -> None:
    up.script(Stall())
    pool = make_pool(first_byte_timeout=0.2)
    started = time.monotonic()
    with pytest.raises(ReadTimeout):
        await within(chat(pool))
    assert 0.18 < time.monotonic() - started < 1.0
    assert await disconnected(up)
    assert pool.size == 0
    assert await (await chat(pool)).read()
    assert up.connections_opened == 2


async def test_idle_read_timeout_mid_body(up: ScriptedUpstream, make_pool: MakePool) -> None:
    up.script(Stall(after_chunks=2))
    pool = make_pool(idle_read_timeout=0.2)
    response = await chat(pool, stream=True)
    chunks: list[bytes] = []
    stamps = [time.monotonic()]
    with pytest.raises(ReadTimeout):
        await read_on(response, chunks, stamps)
    assert time.monotonic() - stamps[-1] > 0.18
    assert len(sse_data(b"".join(chunks))) == 2
    assert await disconnected(up)
    assert pool.size == 0


async def test_cancelled_request_closes_its_connection(up: ScriptedUpstream, make_pool: MakePool) -> None:
    up.script(Stall())
    pool = make_pool()
    task = asyncio.create_task(chat(pool))
    await until(lambda: bool(up.requests))  # the request reached the upstream
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert await disconnected(up)
    assert pool.size == 0


async def test_reset_before_headers_on_a_new_connection(up: ScriptedUpstream, make_pool: MakePool) -> None:
    up.script(ResetBeforeHeaders())
    pool = make_pool()
    with pytest.raises(RemoteProtocolError):
        await within(chat(pool))
    assert len(up.requests) == 1, "a request sent on a new connection is never sent twice"
    assert pool.size == 0


async def test_reset_before_headers_on_a_reused_connection_is_retried(
    up: ScriptedUpstream, make_pool: MakePool
) -> None:
    up.script(Ok(), ResetBeforeHeaders())
    pool = make_pool()
    assert await (await chat(pool)).read()
    response = await chat(pool)
    assert response.status == 200
    assert await response.read()
    assert [request.connection for request in up.requests] == [1, 1, 2]


async def test_the_retry_after_a_reset_is_once_and_on_a_new_connection(
    up: ScriptedUpstream, make_pool: MakePool
) -> None:
    pool = make_pool()
    assert await pool.warm(2) == 2
    up.script(ResetBeforeHeaders(), ResetBeforeHeaders())
    with pytest.raises(RemoteProtocolError):
        await within(chat(pool))
    assert len(up.requests) == 2, "the request may reach an upstream that fails on it: never more than twice"
    assert up.requests[1].connection == 3, "not the other idle connection, which may be as stale"


async def test_stale_keep_alive_connection_is_replaced(up: ScriptedUpstream, make_pool: MakePool) -> None:
    pool = make_pool()
    assert await (await chat(pool)).read()
    assert up.close_idle() == 1
    # At once: the close may cross the next request on the wire.
    assert await (await chat(pool)).read()
    assert up.close_idle() == 1
    await until(lambda: pool.idle == 0)
    assert await (await chat(pool)).read()
    assert up.connections_opened == 3
    assert pool.size == 1


async def test_reset_mid_stream(up: ScriptedUpstream, make_pool: MakePool) -> None:
    up.script(ResetMidStream(after_chunks=2))
    pool = make_pool()
    response = await chat(pool, stream=True)
    chunks: list[bytes] = []
    with pytest.raises(RemoteProtocolError):
        await read_on(response, chunks)
    assert len(sse_data(b"".join(chunks))) == 2
    assert not response.complete
    assert pool.size == 0


async def test_malformed_chunk_framing(up: ScriptedUpstream, make_pool: MakePool) -> None:
    up.script(MalformedChunk())
    pool = make_pool()
    response = await chat(pool, stream=True)
    assert response.status == 200
    assert sse_data(await response.next_chunk())
    with pytest.raises(RemoteProtocolError):
        await response.next_chunk()
    assert pool.size == 0


async def test_an_answer_that_is_not_http(up: ScriptedUpstream, make_pool: MakePool) -> None:
    up.script(Raw(b"SMTP ready\r\n\r\n", close=False))
    pool = make_pool()
    with pytest.raises(RemoteProtocolError):
        await chat(pool)
    assert pool.size == 0


async def test_closing_a_half_read_response_closes_its_connection(up: ScriptedUpstream, make_pool: MakePool) -> None:
    up.script(Ok(tokens=20, tpot_ms=30))
    pool = make_pool()
    response = await chat(pool, stream=True)
    assert await response.next_chunk()
    response.close()
    assert await disconnected(up)
    assert (pool.size, pool.idle) == (0, 0)
    with pytest.raises(ResponseClosed):
        await response.next_chunk()
    assert await (await chat(pool)).read()
    assert up.connections_opened == 2


async def test_a_body_completed_while_reading_is_paused_leaves_the_connection_usable(
    up: ScriptedUpstream, make_pool: MakePool
) -> None:
    # Just over the high-water mark: the last read pauses the socket and completes the body at once.
    body = b"x" * (HIGH_WATER + 1000)
    up.script(Status(200, body))
    pool = make_pool(first_byte_timeout=0.5)
    response = await chat(pool)
    await until(lambda: response.complete)
    assert await response.read() == body
    assert await (await chat(pool)).read()
    assert up.connections_opened == 1


async def test_back_pressure_stops_reading_the_socket(up: ScriptedUpstream, make_pool: MakePool) -> None:
    body = bytes(range(256)) * (4 * 4096)  # 4 MiB
    size = 64 * 1024
    chunked = b"".join(b"%x\r\n%s\r\n" % (size, body[i : i + size]) for i in range(0, len(body), size))
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    up.script(Raw(head + chunked + b"0\r\n\r\n", close=False))
    pool = make_pool()
    response = await chat(pool)
    await until(lambda: response._conn is not None and response._conn.paused)
    # Above the mark by at most one socket read (256 KiB), never the whole body.
    assert HIGH_WATER < response._buffered <= HIGH_WATER + 256 * 1024 + 16 * 1024
    assert response._conn is not None
    assert response._conn.paused
    assert not response.complete
    assert await response.read() == body
    assert await (await chat(pool)).read()
    assert up.connections_opened == 1


async def test_body_delimited_by_the_connection_close(up: ScriptedUpstream, make_pool: MakePool) -> None:
    body = b"0123456789" * 30_000
    up.script(Raw(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n" + body, close=True))
    pool = make_pool()
    response = await chat(pool)
    assert await response.read() == body
    assert response.complete
    assert pool.size == 0


async def test_connection_close_from_upstream_is_not_reused(up: ScriptedUpstream, make_pool: MakePool) -> None:
    up.script(Status(200, {"ok": True}, {"connection": "close"}))
    pool = make_pool()
    assert json.loads(await (await chat(pool)).read()) == {"ok": True}
    assert pool.size == 0
    assert await (await chat(pool)).read()
    assert [request.connection for request in up.requests] == [1, 2]


async def test_maintain_replaces_expired_idle_connections(up: ScriptedUpstream, make_pool: MakePool) -> None:
    pool = make_pool(warm=2, keepalive_expiry=0.15)
    assert await pool.warm() == 2
    first = list(pool._idle)
    task = asyncio.create_task(pool.maintain(0.05))
    try:
        await until(lambda: up.connections_opened >= 4)
        await until(lambda: pool.idle == 2)
        assert all(conn.closed for conn in first)
        assert not set(pool._idle) & set(first)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_maintain_keeps_fresh_connections_and_tops_up(up: ScriptedUpstream, make_pool: MakePool) -> None:
    pool = make_pool(warm=2)
    task = asyncio.create_task(pool.maintain(0.05))
    try:
        await until(lambda: pool.idle == 2)
        await asyncio.sleep(0.2)  # not a wait for a condition: four maintenance rounds, which must open nothing
        assert up.connections_opened == 2, "connections within keepalive_expiry are kept"
        assert up.close_idle() == 2
        await until(lambda: up.connections_opened == 4 and pool.idle == 2)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_aclose_closes_everything(up: ScriptedUpstream, make_pool: MakePool) -> None:
    up.script(Stall(after_chunks=1))
    pool = make_pool(max_connections=1)
    busy = await chat(pool, stream=True)
    waiting = asyncio.create_task(chat(pool))
    await until(lambda: len(pool._waiters) == 1)
    await pool.aclose()
    with pytest.raises(ConnectError):
        await within(waiting)
    assert sse_data(await busy.next_chunk())
    with pytest.raises(ResponseClosed):
        await within(busy.next_chunk())
    assert pool.size == 0
    assert await disconnected(up)
    with pytest.raises(ConnectError):
        await chat(pool)


async def test_aclose_does_not_pass_a_cut_length_less_body_as_complete(
    up: ScriptedUpstream, make_pool: MakePool
) -> None:
    up.script(Raw(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\npartial", close=False))
    pool = make_pool()
    response = await chat(pool)
    assert await response.next_chunk() == b"partial"
    await pool.aclose()
    with pytest.raises(ResponseClosed):
        await within(response.next_chunk())
    assert not response.complete


SCENARIOS = [test for name, test in list(globals().items()) if name.startswith("test_")]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda test: test.__name__.removeprefix("test_"))
def test_on_uvloop(scenario: Callable[..., Awaitable[None]]) -> None:
    """Every scenario above again on uvloop, the loop the gateway serves on: its transports are not asyncio's."""
    uvloop = pytest.importorskip("uvloop")

    async def run() -> None:
        with ScriptedUpstream() as up:
            pools: list[Pool] = []
            fixtures = {"up": up, "make_pool": pool_factory(up, pools)}
            try:
                await scenario(**{name: fixtures[name] for name in inspect.signature(scenario).parameters})
            finally:
                for pool in pools:
                    await pool.aclose()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run())


async def test_a_process_out_of_descriptors_is_told_apart_from_an_upstream_that_refuses() -> None:
    server = await asyncio.start_server(lambda _r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = Pool(f"http://127.0.0.1:{port}", PoolLimits(warm=0))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[socket.socket] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
        with contextlib.suppress(OSError):
            while len(held) < 64:
                held.append(socket.socket())  # until this process has no descriptor left
        with pytest.raises(DescriptorsExhausted):
            await pool.request(b"GET", b"/", b"", b"")
    finally:
        for sock in held:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        await pool.aclose()
        server.close()
        await server.wait_closed()
    assert not issubclass(DescriptorsExhausted, ConnectError)  # so the backend is neither marked down nor retried
