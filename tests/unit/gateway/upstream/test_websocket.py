"""The upstream socket's framing, read by wsproto's server side (an independent implementation of RFC 6455)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Ping, Pong, Request, TextMessage

from gateway.upstream.websocket import SocketClosed, SocketTurn, UpstreamSocket, frame


class Transport:
    """What the socket writes, kept."""

    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def server() -> WSConnection:
    """wsproto's server, past the handshake of a client it saw."""
    peer = WSConnection(ConnectionType.SERVER)
    client = WSConnection(ConnectionType.CLIENT)
    peer.receive_data(client.send(Request(host="up", target="/v1/responses")))
    assert isinstance(next(iter(peer.events())), Request)
    peer.send(AcceptConnection())
    return peer


async def opened() -> tuple[UpstreamSocket, Transport]:
    socket = UpstreamSocket(None, b"key")
    transport = Transport()
    socket.connection_made(transport)  # type: ignore[arg-type]
    socket.opened.set_result(None)
    return socket, transport


@pytest.mark.parametrize("size", [0, 5, 125, 126, 65535, 65536, 200_000])
def test_frames_out_are_masked_text_frames_a_server_reads(size: int) -> None:
    peer = server()
    body = ("é" * (size // 2) + "x" * (size % 2)).encode()
    peer.receive_data(frame(0x1, body))
    events = list(peer.events())
    assert len(events) == 1
    assert isinstance(events[0], TextMessage)
    assert events[0].data.encode() == body


async def test_events_in_whole_split_and_fragmented_and_a_ping_is_answered() -> None:
    socket, transport = await opened()
    turn = socket.turn = SocketTurn(socket)
    peer = server()
    first = peer.send(TextMessage(data='{"type":"response.created","response":{"id":"resp_1"}}'))
    part = peer.send(TextMessage(data='{"type":"response.output_text.delta",', message_finished=False))
    rest = peer.send(TextMessage(data='"delta":"hé"}', message_finished=True))
    ping = peer.send(Ping(payload=b"hi"))
    end = peer.send(TextMessage(data='{"type":"response.completed","response":{"id":"resp_1"}}'))
    data = first + part + ping + rest + end
    for i in range(0, len(data), 7):  # frames cut anywhere
        socket.data_received(data[i : i + 7])
    assert turn.ended
    chunk = await turn.next_chunk()
    assert chunk == (
        b'data: {"type":"response.created","response":{"id":"resp_1"}}\n\n'
        + b'data: {"type":"response.output_text.delta","delta":"h\xc3\xa9"}\n\n'
        + b'data: {"type":"response.completed","response":{"id":"resp_1"}}\n\n'
    )
    assert await turn.next_chunk() == b""
    assert socket.last == "resp_1"
    assert socket.usable
    peer.receive_data(transport.written)
    assert [type(e) for e in peer.events()] == [Pong]


async def test_a_close_mid_turn_fails_the_turn_and_is_answered() -> None:
    socket, transport = await opened()
    turn = socket.turn = SocketTurn(socket)
    peer = server()
    socket.data_received(peer.send(TextMessage(data='{"type":"response.created","response":{"id":"resp_2"}}')))
    socket.data_received(peer.send(CloseConnection(code=1011, reason="bye")))
    assert await turn.next_chunk()
    with pytest.raises(SocketClosed, match="1011 bye"):
        await turn.next_chunk()
    assert socket.closed
    assert transport.closed
    peer.receive_data(transport.written)
    events: list[Any] = list(peer.events())
    assert isinstance(events[0], CloseConnection)
    assert events[0].code == 1011


async def test_an_error_event_first_is_the_turn_s_status() -> None:
    socket, _ = await opened()
    peer = server()
    message = b'{"type":"error","status":429,"error":{"type":"rate_limit_error","message":"slow down"}}'
    loop = asyncio.get_running_loop()
    loop.call_soon(socket.data_received, peer.send(TextMessage(data=message.decode())))
    turn = await socket.create(b'{"type":"response.create"}', 5.0)
    assert turn.status == 429
    assert await turn.read() == b'{"error":{"type":"rate_limit_error","message":"slow down"}}'
    assert socket.usable  # the socket goes on
