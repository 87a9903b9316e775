"""Errors on the Messages route in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.

The pipeline answers every error in OpenAI's shape (gateway/errors.py); on this route each one is rewritten
on its way out (`anthropic_body`), with the status Anthropic's SDKs expect: they retry 408, 409, 429 and every
5xx, and read `overloaded_error` (529) as "try again later". A gateway 503 (every connection busy, out of
descriptors, shutting down) is such an overload, so it goes out as 529.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from gateway import errors

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
STATUSES = {503: 529}  # the gateway's overload, as Anthropic's API says it
# Told to the client with every refusal that asking again cannot change (a bad request, a wrong key, an unknown
# model): Anthropic's SDKs honour it, and Claude Code otherwise retries a 401 for minutes.
NO_RETRY = (b"x-should-retry", b"false")
FINAL = frozenset({400, 401, 403, 404, 405, 413, 415})


def status_of(status: int) -> int:
    return STATUSES.get(status, status)


def error_headers(status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> list[tuple[bytes, bytes]]:
    """An error's headers for its rewritten body: the new length, and whether asking again can help."""
    kept = [(k, v) for k, v in headers if k != b"content-length" and k != b"x-should-retry"]
    kept.append((b"content-length", str(len(body)).encode()))
    if status in FINAL:
        kept.append(NO_RETRY)
    return kept


def error_type(status: int) -> str:
    found = TYPES.get(status)
    if found is not None:
        return found
    return "api_error" if status >= 500 else "invalid_request_error"


def payload(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def anthropic_body(status: int, body: bytes) -> bytes:
    """An error body (OpenAI's shape, or already Anthropic's) in Anthropic's shape for `status`."""
    try:
        parsed = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict) and parsed.get("type") == "error" and isinstance(parsed.get("error"), dict):
        return body  # a native backend's own error, passed on as it is
    error = parsed.get("error") if isinstance(parsed, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str) or not message:
        message = f"request failed with status {status}"
    return orjson.dumps(payload(status, message))


def error_event(status: int, message: str) -> bytes:
    """A failure after the first byte of a stream: Anthropic's `error` event (the stream ends after it)."""
    return b"event: error\ndata: " + orjson.dumps(payload(status, message)) + b"\n\n"


def stream_error(data: bytes) -> bytes:
    """The pipeline's mid-stream error (`data: {"error": ...}` then `data: [DONE]`) as Anthropic's error event."""
    start = data.find(b"{")
    end = data.find(b"\n\n", start)
    body = data[start:end] if start >= 0 and end > start else b""
    try:
        parsed = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        parsed = None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    status = 529 if isinstance(error, dict) and error.get("code") == "gateway_shutdown" else 500
    return error_event(status, message if isinstance(message, str) else "the stream failed")


class Refusal(errors.BadRequestError):
    """A Messages request the gateway cannot serve as asked: a 400 naming the field and the reason."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param=param, code="messages_unsupported")
