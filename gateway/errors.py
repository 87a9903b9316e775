"""Errors, always answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}.

    GatewayError                      any status; carries type, code, param and extra headers
     ├─ BadRequestError           400 invalid_request_error
     ├─ AuthenticationError       401 invalid_api_key
     ├─ PermissionDeniedError     403
     ├─ NotFoundError             404 model_not_found / unknown_url
     ├─ MethodNotAllowedError     405
     ├─ PayloadTooLargeError      413
     ├─ RateLimitError            429 rate_limit_exceeded (+ retry-after)
     ├─ UpstreamError             502 the backend failed or answered nonsense
     ├─ ServiceUnavailableError   503
     └─ UpstreamTimeoutError      504

`upstream/attempts.py`'s `from_pool_error` is the one place where transport failures become statuses;
`from_upstream` turns an upstream's error answer (whatever its dialect: OpenAI, Azure, vLLM) into our shape
with its status.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.wire.completion import sse


class GatewayError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        if code is not None:
            self.code = code
        self.param = param
        self.headers = headers or []
        self.details: dict[str, Any] = {}  # more fields of the error object, e.g. Azure's innererror

    def payload(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": {**error, **self.details} if self.details else error}

    def body(self) -> bytes:
        return orjson.dumps(self.payload())

    def sse_event(self) -> bytes:
        """The error as one SSE event, then the end of the stream, for failures after the first byte."""
        return sse(self.body()) + sse(b"[DONE]")


class BadRequestError(GatewayError):
    status, type = 400, "invalid_request_error"


class AuthenticationError(GatewayError):
    status, type, code = 401, "invalid_request_error", "invalid_api_key"


class PermissionDeniedError(GatewayError):
    status, type, code = 403, "invalid_request_error", "model_not_allowed"


class NotFoundError(GatewayError):
    status, type, code = 404, "invalid_request_error", "model_not_found"


class MethodNotAllowedError(GatewayError):
    status, type, code = 405, "invalid_request_error", "method_not_allowed"


class PayloadTooLargeError(GatewayError):
    status, type, code = 413, "invalid_request_error", "request_too_large"


class RateLimitError(GatewayError):
    status, type, code = 429, "requests", "rate_limit_exceeded"


class UpstreamError(GatewayError):
    status, type, code = 502, "upstream_error", "bad_gateway"


class ServiceUnavailableError(GatewayError):
    status, type, code = 503, "server_error", "service_unavailable"


class UpstreamTimeoutError(GatewayError):
    status, type, code = 504, "upstream_error", "upstream_timeout"


FIELD = "Field '"


def from_upstream(status: int, body: bytes, backend: str) -> GatewayError:
    """An upstream's error response in our shape, with its status. Unknown bodies are quoted, shortened.

    A 401 or 403 refuses the gateway's own credential for the backend, never the client's (which is not
    forwarded): passed on as is it would tell the client that its key is wrong, so it becomes a 502.
    """
    if status in (401, 403):
        return UpstreamError(
            f"the gateway's credential for backend {backend!r} was refused (upstream status {status})",
            code="upstream_auth_failed",
        )
    message, type_, code, param = "", None, None, None
    details: dict[str, Any] = {}
    try:
        parsed = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        parsed = None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict):
        message = str(error.get("message") or "")
        type_ = _str_or_none(error.get("type"))
        code = _str_or_none(error.get("code"))  # vLLM sends the status as an int
        param = _str_or_none(error.get("param"))
        if isinstance(error.get("innererror"), dict):
            details["innererror"] = error["innererror"]  # Azure: which content filter fired, and why
    elif isinstance(error, str):
        message = error
    elif isinstance(parsed, dict) and isinstance(parsed.get("message"), str):
        message = parsed["message"]
    if not message:
        text = body[:200].decode("utf-8", "replace").strip()
        message = f"backend {backend!r} answered {status}" + (f": {text}" if text else "")
    if type_ is None:
        type_ = "invalid_request_error" if 400 <= status < 500 else "upstream_error"
    if param is None and message.startswith(FIELD):
        # llama.cpp names the parameter in its message only ("Field 'n': Value must be between 1 <= value <= 4").
        end = message.find("'", len(FIELD))
        param = message[len(FIELD) : end] if end > len(FIELD) else None
    result = GatewayError(message, status=status, type=type_, code=code, param=param)
    result.details = details
    return result


def not_json(backend: str) -> UpstreamError:
    return UpstreamError(f"backend {backend!r} answered 200 with a body that is not JSON", code="upstream_invalid_body")


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)
