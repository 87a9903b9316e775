"""The response cycles that write a marked head with its body's first part: uvicorn's bytes, in fewer writes.

Each case is sent through uvicorn's own RequestResponseCycle and through ours (the ASGI one, and the direct
one the proxy routes use), each on a transport that records its writes: the bytes on the wire must be
identical, and a head marked BODY_FOLLOWS must leave with its body.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from gateway.server.direct import Direct
from gateway.server.protocol import Cycle
from gateway.server.reply import BODY_FOLLOWS

DEFAULT_HEADERS = [(b"date", b"Tue, 01 Dec 2026 12:00:00 GMT")]
JSON = (b"content-type", b"application/json")


class Recording:
    """A transport that keeps what is written to it."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        if data:
            self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def cycle(kind: type[RequestResponseCycle], method: str = "POST", keep_alive: bool = True) -> RequestResponseCycle:
    transport: Any = Recording()
    scope: Any = {"type": "http", "method": method, "path": "/v1/chat/completions", "headers": []}
    made = RequestResponseCycle(
        scope=scope,
        transport=transport,
        flow=FlowControl(transport),
        logger=logging.getLogger("test"),
        access_logger=logging.getLogger("test.access"),
        access_log=False,
        default_headers=DEFAULT_HEADERS,
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=keep_alive,
        on_response=lambda: None,
    )
    made.__class__ = kind  # as GatewayProtocol does to the cycle uvicorn made
    return made


def direct(keep_alive: bool = True) -> Any:
    """The proxy routes' cycle (always a POST), on a recording transport."""
    transport: Any = Recording()
    return Direct(
        transport, FlowControl(transport), [], 0.0, DEFAULT_HEADERS, None, b"", keep_alive, False, lambda: None
    )


def made(kind: str, method: str = "POST", keep_alive: bool = True) -> Any:
    return direct(keep_alive) if kind == "direct" else cycle(Cycle, method, keep_alive)


KINDS = ["cycle", "direct"]


def start(status: int, headers: list[tuple[bytes, bytes]], marked: bool = True) -> dict[str, Any]:
    message: dict[str, Any] = {"type": "http.response.start", "status": status, "headers": headers}
    if marked:
        message[BODY_FOLLOWS] = True
    return message


def body(data: bytes, more: bool = False) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": more}


WHOLE = b'{"id":"chatcmpl-1","choices":[]}'
CASES: dict[str, tuple[str, bool, list[dict[str, Any]]]] = {
    "whole body": ("POST", True, [start(200, [JSON, (b"content-length", b"%d" % len(WHOLE))]), body(WHOLE)]),
    "error body": ("POST", True, [start(429, [JSON, (b"content-length", b"2"), (b"retry-after", b"1")]), body(b"{}")]),
    "stream": (
        "POST",
        True,
        [
            start(200, [(b"content-type", b"text/event-stream")]),
            *(body(b"data: %b\n\n" % event, True) for event in (b"1", b"2", b"[DONE]")),
            body(b""),
        ],
    ),
    "stream, first part empty": (
        "POST",
        True,
        [start(200, [(b"content-type", b"text/event-stream")]), body(b"", True), body(b"data: 1\n\n", True), body(b"")],
    ),
    "client asked to close": ("POST", False, [start(200, [(b"content-length", b"2")]), body(b"{}")]),
    "204": ("POST", True, [start(204, []), body(b"")]),
    "HEAD": ("HEAD", True, [start(200, [(b"content-length", b"2")]), body(b"")]),
    "unmarked": ("POST", True, [start(200, [(b"content-length", b"2")], marked=False), body(b"{}")]),
    "connection header": (
        "POST",
        True,
        [start(200, [(b"content-length", b"2"), (b"connection", b"close")]), body(b"{}")],
    ),
    "mixed-case name": ("POST", True, [start(200, [(b"Content-Length", b"2"), (b"X-Thing", b"1")]), body(b"{}")]),
}


async def run(made: Any, messages: list[dict[str, Any]]) -> Any:
    for message in messages:
        await made.send(message)
    return made


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", list(CASES))
async def test_the_same_bytes_as_uvicorn(case: str, kind: str) -> None:
    method, keep_alive, messages = CASES[case]
    if kind == "direct" and method != "POST":
        pytest.skip("the direct cycle serves POSTs only")
    theirs = await run(cycle(RequestResponseCycle, method, keep_alive), messages)
    ours = await run(made(kind, method, keep_alive), messages)
    assert b"".join(ours.transport.writes) == b"".join(theirs.transport.writes)
    assert (ours.response_complete, ours.keep_alive, ours.transport.closed) == (
        theirs.response_complete,
        theirs.keep_alive,
        theirs.transport.closed,
    )


@pytest.mark.parametrize("case", ["whole body", "error body", "client asked to close", "204", "mixed-case name"])
async def test_a_whole_answer_in_one_call_is_the_same_bytes(case: str) -> None:
    """The pipeline's one call for a whole response writes what the two messages would, in one write."""
    _, keep_alive, messages = CASES[case]
    theirs = await run(cycle(RequestResponseCycle, "POST", keep_alive), messages)
    ours = direct(keep_alive)
    await ours.answer(messages[0]["status"], messages[0]["headers"], messages[1]["body"])
    assert ours.transport.writes == [b"".join(theirs.transport.writes)]
    assert (ours.response_complete, ours.keep_alive, ours.transport.closed) == (
        theirs.response_complete,
        theirs.keep_alive,
        theirs.transport.closed,
    )


async def test_a_whole_answer_must_match_its_content_length() -> None:
    for wrong in (b"{}{}", b"{"):
        with pytest.raises(RuntimeError, match="than Content-Length"):
            await direct().answer(200, [(b"content-length", b"2")], wrong)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", ["whole body", "error body", "stream", "client asked to close"])
async def test_a_marked_head_leaves_with_the_first_body_part(case: str, kind: str) -> None:
    method, keep_alive, messages = CASES[case]
    theirs = await run(cycle(RequestResponseCycle, method, keep_alive), messages)
    ours = await run(made(kind, method, keep_alive), messages)
    assert len(ours.transport.writes) == len(theirs.transport.writes) - 1
    assert ours.transport.writes[0].startswith(b"HTTP/1.1 ")
    assert ours.transport.writes[0].endswith(messages[1]["body"] + (b"\r\n" if case == "stream" else b""))


@pytest.mark.parametrize("kind", KINDS)
async def test_a_marked_head_waits_for_nothing_else(kind: str) -> None:
    """Until the first body part, nothing is written; the head is not lost if that part is empty."""
    ours = made(kind)
    await ours.send(start(200, [(b"content-type", b"text/event-stream")]))
    assert ours.transport.writes == []
    await ours.send(body(b"", True))
    assert ours.transport.writes[0].endswith(b"transfer-encoding: chunked\r\n\r\n")


@pytest.mark.parametrize(("name", "value"), [(b"x-bad", b"a\x01b"), (b"x-bad", b"a\r\nb"), (b"bad name", b"1")])
async def test_an_invalid_header_is_refused_as_uvicorn_does(name: bytes, value: bytes) -> None:
    ours: Any
    for ours in (cycle(RequestResponseCycle), made("cycle"), made("direct")):
        with pytest.raises(RuntimeError, match="Invalid HTTP header"):
            await ours.send(start(200, [JSON, (name, value), (b"content-length", b"2")]))
        assert ours.response_started  # so the connection is closed rather than a second head sent
        assert ours.transport.writes == []


@pytest.mark.parametrize("kind", KINDS)
async def test_a_body_longer_than_its_content_length_is_refused(kind: str) -> None:
    ours = made(kind)
    await ours.send(start(200, [(b"content-length", b"2")]))
    with pytest.raises(RuntimeError, match="longer than Content-Length"):
        await ours.send(body(b"{}{}"))


def test_uvicorn_still_starts_each_cycle_where_the_protocol_swaps_its_class() -> None:
    """If uvicorn renames the hook, heads would quietly go out on their own again: fail here instead."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from gateway.server.protocol import GatewayProtocol

    assert "_start_asgi_task" in vars(HttpToolsProtocol)
    assert "_start_asgi_task" in vars(GatewayProtocol)


def test_the_deleted_bytes_are_what_uvicorns_regexes_refuse() -> None:
    from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE

    from gateway.server.direct import BAD_NAME, BAD_VALUE

    for code in range(256):
        byte = bytes([code])
        assert (HEADER_RE.search(byte) is not None) == (byte in BAD_NAME), code
        assert (HEADER_VALUE_RE.search(byte) is not None) == (byte in BAD_VALUE), code


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("value", [b"a\x01b", b"a\rb", b"a\nb", b"\x7f", b"a\r\nx-injected: 1"])
async def test_a_bad_value_is_refused_after_its_name_is_known(value: bytes, kind: str) -> None:
    """A name checked once is not a free pass for its values."""
    for headers in ([JSON, (b"x-known", b"fine")], [JSON, (b"x-known", value)]):
        ours = made(kind)
        sent = ours.send(start(200, [*headers, (b"content-length", b"2")]))
        if headers[1][1] == b"fine":
            await sent
            continue
        with pytest.raises(RuntimeError, match="Invalid HTTP header value"):
            await sent


@pytest.mark.parametrize("value", [b"a\x01b", b"a\r\nx-injected: 1"])
async def test_a_bad_value_is_refused_when_every_name_is_known(value: bytes) -> None:
    """The direct cycle's shortest path (no content-length, every name seen before) checks values too."""
    ours = made("direct")
    await ours.send(start(200, [JSON, (b"x-known", b"fine")]))
    ours = made("direct")
    with pytest.raises(RuntimeError, match="Invalid HTTP header value"):
        await ours.send(start(200, [JSON, (b"x-known", value)]))
