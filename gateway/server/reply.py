"""Replies sent whole or piece by piece through a responder: an error the gateway makes, a whole answer, a
plugin's pieces, the last words of a request stopped where it stood; and the mark that lets a response head
leave with its body (the HTTP/1.1 protocol reads it).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from starlette.types import Send

    from gateway import errors
    from gateway.context import Exchange
    from gateway.plugin import Outcome, ResponseHead, Tap
    from gateway.server.responder import Responder

log = logging.getLogger("sluice")

# In an `http.response.start` message: the body's first part follows at once, so the server may hold the head
# and write both together (server/protocol.py does). Servers ignore keys they do not know (ASGI).
BODY_FOLLOWS = "sluice.body_follows"
JSON = (b"content-type", b"application/json")


async def send_error(send: Send, exc: errors.GatewayError, rid: str) -> None:
    """The error as an OpenAI-format JSON answer, with the request's id."""
    body = exc.body()
    headers = [JSON, (b"content-length", str(len(body)).encode()), (b"x-request-id", rid.encode()), *exc.headers]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers, BODY_FOLLOWS: True})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_whole(
    responder: Responder, head: ResponseHead, body: bytes, outcome: Outcome, taps: tuple[Tap, ...]
) -> None:
    """A whole answer: the head and body in one write where the responder can."""
    head.headers.append((b"content-length", str(len(body)).encode()))
    for tap in taps:
        tap(body)
        tap(b"")
    await responder.answer(head.status, head.headers, body)
    outcome.complete = True


async def send_pieces(
    send: Send, head: ResponseHead, pieces: AsyncIterator[bytes], outcome: Outcome, taps: tuple[Tap, ...]
) -> None:
    """A plugin's answer made piece by piece (a cached stream replayed)."""
    await send({"type": "http.response.start", "status": head.status, "headers": head.headers})
    async for piece in pieces:
        for tap in taps:
            tap(piece)
        await send({"type": "http.response.body", "body": piece, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    outcome.complete = True


async def end_early(ex: Exchange, responder: Responder, outcome: Outcome, error: errors.GatewayError) -> None:
    """End a request that was stopped where it stood: the error as the response, or as the last event."""
    outcome.error = outcome.error or error.message
    try:
        if ex.overhead_ms:  # set just before the head went out: the body is under way
            if ex.stream:  # a whole answer is one message: it went out whole, or cannot be ended cleanly
                await responder.send({"type": "http.response.body", "body": error.sse_event(), "more_body": False})
        else:
            await send_error(responder.send, error, ex.request_id)
            outcome.status = error.status
    except Exception:
        log.debug("request %s: could not end it before shutdown", ex.request_id, exc_info=True)
