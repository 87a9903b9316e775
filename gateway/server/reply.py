"""A reply the gateway makes itself (an error), and the mark that lets a response head leave with its body.

Both the pipeline and the Responses API answer errors the same way, and the HTTP/1.1 protocol reads the mark,
so they live here rather than in any one of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import Send

    from gateway import errors

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
