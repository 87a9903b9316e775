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

What a client is told of an upstream's failure is generic: never an internal address, never the text of
a failure that is not the client's doing (the upstream's 5xx body, its 429 about the gateway's account,
its refusal of the gateway's credential). An upstream's 4xx that is about the request itself (a 400 on a
field, a 404 of an id, Azure's content filter) keeps its message, type, code and param, with identifiers
scrubbed (organisation and project ids, keys, URLs, addresses). The detail goes to the log: `detail`, set
beside the message, is what the access log and the attempt log write, and is never sent.
"""

from __future__ import annotations

import re
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
        self.detail: str | None = None  # for the log only, never sent: what the message leaves out

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

# Identifiers an upstream's message may carry that are the gateway's, not the client's: its organisation and
# project, a key (even masked), the URLs and addresses behind it.
SCRUBBED = re.compile(
    r"\borg-[A-Za-z0-9]{6,}"
    r"|\bproj_[A-Za-z0-9]{6,}"
    r"|\b(?:sk|rk|pk)-[A-Za-z0-9_*.-]{4,}"
    r"|\b[a-z][a-z0-9+.-]*://[^\s'\"]+"
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b"
    r"|\[[0-9a-fA-F:]*:[0-9a-fA-F:]*\](?::\d{1,5})?"
    r"|\b[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+:\d{2,5}\b"
    r"|\blocalhost:\d{2,5}\b"
)
TOKEN = re.compile(r"[A-Za-z0-9_.\[\]-]{1,128}")  # what a type, code or param looks like


def scrub(text: str) -> str:
    """`text` with the gateway's identifiers (ids, keys, URLs, addresses) replaced."""
    return SCRUBBED.sub("[redacted]", text)


def from_upstream(status: int, body: bytes, backend: str, model: str | None = None) -> GatewayError:
    """An upstream's error response in our shape, with its status; what the client is told is generic unless
    the error is about its own request (see the module's docstring), and `detail` keeps the rest for the log.

    A 401 or 403 refuses the gateway's own credential for the backend, never the client's (which is not
    forwarded): passed on as is it would tell the client that its key is wrong, so it becomes a 502.
    """
    message, type_, code, param = "", None, None, None
    details: dict[str, Any] = {}
    try:
        parsed = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        parsed = None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict):
        message = str(error.get("message") or "")
        type_ = _token(error.get("type"))
        code = _token(error.get("code"))  # vLLM sends the status as an int
        param = _token(error.get("param"))
        if isinstance(error.get("innererror"), dict):
            details["innererror"] = error["innererror"]  # Azure: which content filter fired, and why
    elif isinstance(error, str):
        message = error
    elif isinstance(parsed, dict) and isinstance(parsed.get("message"), str):
        message = parsed["message"]
    text = message or body[:200].decode("utf-8", "replace").strip()
    detail = f"backend {backend!r} answered {status}" + (f": {text}" if text else "")
    what = f"model {model!r}" if model is not None else f"backend {backend!r}"
    if status in (401, 403):
        result: GatewayError = UpstreamError(
            f"the gateway's credential for backend {backend!r} was refused (upstream status {status})",
            code="upstream_auth_failed",
        )
    elif status == 429:  # the gateway's account is limited, not the client: its quota is nobody else's business
        result = RateLimitError(
            f"{what}: the upstream is rate limiting the gateway; please try again shortly",
            type=type_ or "requests",
            code=code or "rate_limit_exceeded",
        )
    elif status >= 500 or status < 400:
        result = GatewayError(
            f"{what}: the upstream failed (status {status})", status=status, type="upstream_error", code=code
        )
    elif message:  # the client's own request was refused: it is told why, without the gateway's identifiers
        if param is None and message.startswith(FIELD):
            # llama.cpp names the parameter in its message only ("Field 'n': Value must be between 1 <= value <= 4").
            end = message.find("'", len(FIELD))
            param = _token(message[len(FIELD) : end]) if end > len(FIELD) else None
        result = GatewayError(
            scrub(message), status=status, type=type_ or "invalid_request_error", code=code, param=param
        )
        result.details = details
    else:
        result = GatewayError(
            f"{what}: the upstream refused the request (status {status})",
            status=status,
            type=type_ or "invalid_request_error",
            code=code,
            param=param,
        )
    result.detail = detail
    return result


def not_json(backend: str) -> UpstreamError:
    error = UpstreamError("the upstream answered 200 with a body that is not JSON", code="upstream_invalid_body")
    error.detail = f"backend {backend!r} answered 200 with a body that is not JSON"
    return error


def _token(value: object) -> str | None:
    """A type, code or param as the client may see it: a short identifier, else nothing."""
    if value is None:
        return None
    text = str(value)
    return text if TOKEN.fullmatch(text) and SCRUBBED.search(text) is None else None
