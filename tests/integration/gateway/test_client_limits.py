"""What a client sends before its body is bounded: the head's size, the time to send the head and the body.

Raw sockets, since no HTTP client sends a half request or an 8 MiB header on purpose.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator

import pytest

from tests.support.gateway import RunningGateway, gateway_thread

CONFIG = """
backends: {sim: {type: simulated, ttft_ms: 1, tpot_ms: 0, tokens: 2}}
models: {m: {backend: sim}}
limits: {max_header_bytes: 8192, header_timeout_s: 0.5, body_timeout_s: 0.5}
"""
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'


@pytest.fixture(scope="module")
def gateway() -> Iterator[RunningGateway]:
    with gateway_thread(CONFIG) as gw:
        yield gw


def connect(gw: RunningGateway) -> socket.socket:
    return socket.create_connection(("127.0.0.1", gw.port), timeout=10)


def answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one response to the end of the connection: (status, headers, body)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def assert_openai_error(status: int, headers: dict[str, str], body: bytes, expected: int) -> dict[str, object]:
    assert status == expected, body
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    assert len(headers["x-request-id"]) == 32
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error  # type: ignore[no-any-return]


def request(headers: str = "", body: bytes = BODY) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{headers}"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


def test_a_normal_request_still_passes(gateway: RunningGateway) -> None:
    with connect(gateway) as sock:
        sock.sendall(request("x-pad: " + "p" * 6000 + "\r\n"))
        status, _, body = answer(sock)
    assert status == 200
    assert json.loads(body)["choices"]


@pytest.mark.parametrize("size", [9000, 8 * 1024 * 1024])
def test_a_head_over_the_limit_is_431(gateway: RunningGateway, size: int) -> None:
    with connect(gateway) as sock:
        # The gateway may answer and close before the whole head was sent.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(request("x-big: " + "b" * size + "\r\n"))
        status, headers, body = answer(sock)
    error = assert_openai_error(status, headers, body, 431)
    assert error["code"] == "request_header_too_large"


def test_a_head_is_measured_across_reads() -> None:
    """65 KB of head, a pause, 60 KB more that complete it: 125 KB against the default 64 KiB, however it came."""
    config = CONFIG.replace("max_header_bytes: 8192, header_timeout_s: 0.5", "header_timeout_s: 5")
    with gateway_thread(config) as gw, connect(gw) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        whole = request("x-one: " + "a" * 65_000 + "\r\nx-two: " + "b" * 60_000 + "\r\n")
        cut = whole.index(b"x-two")
        sock.sendall(whole[:cut])
        time.sleep(0.2)  # the first part is read on its own (within the header timeout)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(whole[cut:])
        status, headers, body = answer(sock)
    assert cut < 65_536 < len(whole)
    error = assert_openai_error(status, headers, body, 431)
    assert error["code"] == "request_header_too_large"


def test_a_long_url_counts_too(gateway: RunningGateway) -> None:
    with connect(gateway) as sock:
        sock.sendall(b"GET /v1/models?" + b"q" * 10000 + b" HTTP/1.1\r\nhost: x\r\n\r\n")
        status, headers, body = answer(sock)
    assert_openai_error(status, headers, body, 431)


@pytest.mark.parametrize(
    "partial",
    [b"", b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n", b"POST /v1/chat/completions HTTP/1.1\r\nhost: x"],
)
def test_a_head_that_stalls_is_408(gateway: RunningGateway, partial: bytes) -> None:
    with connect(gateway) as sock:
        sock.sendall(partial)
        started = time.monotonic()
        status, headers, body = answer(sock)
    assert 0.4 < time.monotonic() - started < 5.0
    error = assert_openai_error(status, headers, body, 408)
    assert error["code"] == "request_timeout"


def test_a_body_that_stalls_is_408_and_a_slow_one_is_not(gateway: RunningGateway) -> None:
    with connect(gateway) as sock:
        sock.sendall(request(body=BODY)[: -len(BODY) + 10])
        started = time.monotonic()
        status, headers, body = answer(sock)
    assert 0.4 < time.monotonic() - started < 5.0
    assert_openai_error(status, headers, body, 408)

    with connect(gateway) as sock:  # a body that keeps coming, slower than the timeout in all, is fine
        whole = request()
        sock.sendall(whole[: -len(BODY)])
        for index in range(0, len(BODY), 10):
            time.sleep(0.2)  # not a wait for a condition: the client's own pace, under body_timeout_s
            sock.sendall(BODY[index : index + 10])
        status, _, body = answer(sock)
    assert status == 200, body


@pytest.mark.parametrize(
    "raw",
    [
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: nope\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-bad: a\x00b\r\ncontent-length: 2\r\n\r\n{}",
        b"BREW /v1/chat/completions HTTP/1.1\r\nhost: x\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http at all\r\n\r\n",
    ],
)
def test_requests_the_parser_rejects_get_a_json_400(gateway: RunningGateway, raw: bytes) -> None:
    with connect(gateway) as sock:
        sock.sendall(raw)
        status, headers, body = answer(sock)
    error = assert_openai_error(status, headers, body, 400)
    assert error["code"] == "invalid_http_request"


def test_keep_alive_between_requests_is_not_a_stalled_head(gateway: RunningGateway) -> None:
    with connect(gateway) as sock:
        keep = request().replace(b"connection: close\r\n", b"")
        sock.sendall(keep)
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        time.sleep(0.8)  # not a wait for a condition: idle past header_timeout_s between two requests
        sock.sendall(request())
        status, _, _ = answer(sock)
    assert status == 200


def test_pipelined_requests_are_answered_whole_and_in_order(gateway: RunningGateway) -> None:
    """Three requests in one write, a stream in the middle: three complete responses, in the order asked."""
    keep = request().replace(b"connection: close\r\n", b"")
    streamed = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
    middle = request(body=streamed).replace(b"connection: close\r\n", b"")
    bad = b'{"model":"nope","messages":[{"role":"user","content":"hi"}]}'
    with connect(gateway) as sock:
        sock.sendall(keep + middle + request(body=bad))
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    first, _, rest = data.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200")
    length = int(next(v for k, v in (h.split(b": ", 1) for h in first.split(b"\r\n")[1:]) if k == b"content-length"))
    assert json.loads(rest[:length])["choices"]
    second, _, rest = rest[length:].partition(b"\r\n\r\n")
    assert second.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding: chunked" in second
    events, _, rest = rest.partition(b"0\r\n\r\n")  # the chunked body's end
    decoded = b""
    while events:
        size, _, events = events.partition(b"\r\n")
        decoded += events[: int(size, 16)]
        events = events[int(size, 16) + 2 :]
    assert decoded.startswith(b"data: {")
    assert decoded.endswith(b"data: [DONE]\n\n")
    third, _, body = rest.partition(b"\r\n\r\n")
    assert third.startswith(b"HTTP/1.1 404")
    assert b"connection: close" in third
    assert json.loads(body)["error"]["code"] == "model_not_found"


def test_an_idle_keep_alive_connection_is_closed_after_the_timeout_and_a_busy_one_is_not(
    gateway: RunningGateway,
) -> None:
    """uvicorn's keep-alive timeout (5 s), kept by one timer a connection: an idle connection is closed once it
    has been idle that long, never sooner; one that sends a request every second stays open past it."""
    keep = request().replace(b"connection: close\r\n", b"")
    with connect(gateway) as idle, connect(gateway) as busy:
        idle.sendall(keep)
        assert idle.recv(65536).startswith(b"HTTP/1.1 200")
        answered = time.monotonic()
        idle.setblocking(False)
        closed_after = None
        while time.monotonic() - answered < 15.0:
            busy.sendall(keep)
            assert busy.recv(65536).startswith(b"HTTP/1.1 200")  # the same socket each time: still open
            try:
                if idle.recv(65536) == b"":
                    closed_after = time.monotonic() - answered
                    break
            except BlockingIOError:
                pass
            time.sleep(1.0)  # not a wait for a condition: the busy client's pace, under the timeout
    assert closed_after is not None, "the idle connection was never closed"
    assert 4.5 <= closed_after < 12.0, closed_after
