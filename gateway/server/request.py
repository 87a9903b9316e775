"""Step 1 of the pipeline: the request (ASGI, or server/direct.py's) becomes an Exchange, or a 4xx in OpenAI's format.

The body is read with a size cap (before decompression and after), parsed once with orjson and
checked just enough that the gateway can route it: the model, the fields the endpoint cannot do without,
and `stream`. Everything else is the backend's to judge.
"""

from __future__ import annotations

import json
import random
import zlib
from typing import Any

import orjson
from starlette.types import Receive

from gateway import errors
from gateway.context import Exchange

# In an HTTP/1.1 request's scope: perf_counter() when its first byte arrived, stamped by server/protocol.py
# where it receives the bytes, so that the parse and the dispatch before the application count as overhead.
# A server that does not stamp it (another ASGI server, HTTP/2) leaves the application's own start.
ARRIVED = "sluice.arrived"

# What each endpoint cannot be routed without: (field, accepted types, what to call them in a message).
REQUIRED: dict[str, tuple[str, tuple[type, ...], str]] = {
    "chat/completions": ("messages", (list,), "an array of messages"),
    "completions": ("prompt", (str, list), "a string or an array"),
    "embeddings": ("input", (str, list), "a string or an array"),
    "responses": ("input", (str, list), "a string or an array of input items"),
}
# Fields that stand in for the required one: a Responses request may come from a stored prompt template.
INSTEAD: dict[str, str] = {"responses": "prompt"}


# The deepest nesting of arrays and objects accepted in a request body. Real requests stay under ten levels
# (a tool's JSON schema is the deepest part); orjson reads 1,024 levels but writes only 254, and the body is
# written again whenever it changes (a renamed model, the cache key), so depth is checked before any stage.
MAX_DEPTH = 128


# Top-level fields whose value the gateway decides on (routing, authorisation of the model, what a limit charges,
# the cache's determinism, ownership of stored objects, streaming). JSON leaves a repeated key to the reader
# (RFC 8259: "the names within an object SHOULD be unique"): orjson keeps the last, another parser may keep the
# first, so a body that repeats one of these could be judged on one value and served on the other. A key
# repeated at the top level is among the parsed object's keys, so only those are looked for in the body, each
# as its quoted name; only a body in which one is found twice (a repeat, the same name nested deeper, e.g. in a
# tool's schema, or a string value that equals it) is parsed again, keeping pairs.
DECIDED = (
    "model",
    "stream",
    "stream_options",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "temperature",
    "seed",
    "background",
    "previous_response_id",
    "conversation",
)
# Each name with its quoted form as a body writes it plainly (a name written with escapes, "mod\u0065l", is not
# found so, as it was not by the regular expression over the body this replaces; that expression cost a compiled
# request 11k instructions for a 130-byte body, a count in C for each deciding key the request has far less).
QUOTED = tuple((name, b'"' + name.encode() + b'"') for name in DECIDED)


class ClientGone(Exception):
    """The client disconnected before its request body had arrived."""


def usable_id(value: bytes) -> bool:
    """Whether a client's x-request-id may be the request's own: short and ASCII."""
    return 0 < len(value) <= 128 and value.isascii()


def new_request_id() -> str:
    return f"{random.getrandbits(128):032x}"  # as unique as a uuid4, at a seventh of the cost


def request_id(headers: list[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name == b"x-request-id" and usable_id(value):
            return value.decode()
    return new_request_id()


def expected(headers: list[tuple[bytes, bytes]], limit: int) -> bytes:
    """The body's content-encoding (b"" for none); 413 now if its content-length says it is over `limit`."""
    encoding = b""
    for name, value in headers:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise errors.PayloadTooLargeError(f"request body larger than {limit} bytes")
        if name == b"content-encoding":
            encoding = value.strip().lower()
    return encoding


def taken(body: bytes, encoding: bytes, limit: int) -> bytes:
    """A body that arrived whole with its head (server/direct.py), checked and decoded as read_body does (a
    content-length over the limit is a body over it: the parser has read all of it)."""
    if len(body) > limit:
        raise errors.PayloadTooLargeError(f"request body larger than {limit} bytes")
    if encoding and encoding != b"identity":
        body = decompress(body, encoding, limit)
    return body


async def read_body(receive: Receive, headers: list[tuple[bytes, bytes]], limit: int) -> bytes:
    encoding = expected(headers, limit)
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGone
    body: bytes = message.get("body", b"")
    if message.get("more_body", False):
        parts = [body]
        size = len(body)
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise errors.PayloadTooLargeError(f"request body larger than {limit} bytes")
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(parts)
    elif len(body) > limit:
        raise errors.PayloadTooLargeError(f"request body larger than {limit} bytes")
    if encoding and encoding != b"identity":
        body = decompress(body, encoding, limit)
    return body


def decompress(body: bytes, encoding: bytes, limit: int) -> bytes:
    if encoding == b"gzip":
        decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
    elif encoding == b"deflate":
        decoder = zlib.decompressobj()
    else:
        raise errors.GatewayError(
            f"unsupported content-encoding {encoding.decode('latin-1')!r}; use gzip, deflate or none",
            status=415,
            type="invalid_request_error",
            code="unsupported_content_encoding",
        )
    try:
        # max_length bounds the output, so a small bomb cannot expand past the cap in memory.
        data = decoder.decompress(body, limit + 1)
    except zlib.error as exc:
        raise errors.BadRequestError(f"request body is not valid {encoding.decode()}: {exc}") from None
    if len(data) > limit or decoder.unconsumed_tail:
        raise errors.PayloadTooLargeError(f"decompressed request body larger than {limit} bytes")
    return data


def too_deep(data: dict[str, Any], limit: int) -> bool:
    """Whether arrays and objects in `data` nest more than `limit` levels (walking containers only)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


def repeated(body: bytes, data: dict[str, Any]) -> str | None:
    """The first field of DECIDED that the body's top-level object has more than once, else None."""
    for name, quoted in QUOTED:
        if name in data and body.count(quoted) > 1:
            break
    else:
        return None  # no name the gateway decides on appears twice anywhere: none is repeated at the top level
    top: list[list[tuple[str, Any]]] = []

    def keep(pairs: list[tuple[str, Any]]) -> None:
        top[:] = [pairs]  # called innermost first: the last call is the top-level object

    try:
        json.loads(body, object_pairs_hook=keep)
    except ValueError:  # orjson read it: a difference between the two parsers is not the client's repeat
        return None
    seen: set[str] = set()
    for key, _ in top[0] if top else ():
        if key in seen and key in data and key in DECIDED:
            return key
        seen.add(key)
    return None


def parse(
    endpoint: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    started: float,
    rid: str,
    path_model: str | None = None,
) -> Exchange:
    try:
        data: Any = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise errors.BadRequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise errors.BadRequestError("request body must be a JSON object")
    # A body with fewer brackets than the limit cannot nest deeper: one C-speed count settles most requests.
    if body.count(b"{") + body.count(b"[") > MAX_DEPTH and too_deep(data, MAX_DEPTH):
        raise errors.BadRequestError(f"request body nests arrays and objects deeper than {MAX_DEPTH} levels")
    twice = repeated(body, data)
    if twice is not None:
        raise errors.BadRequestError(f"the field '{twice}' appears more than once in the request body", param=twice)
    if path_model is not None and data.get("model") != path_model:
        # Azure-style paths name the deployment; the body's model (often absent) follows it.
        data["model"] = path_model
        body = orjson.dumps(data)
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise errors.BadRequestError("you must provide a model parameter", param="model", code="missing_model")
    field, types, what = REQUIRED[endpoint]
    value = data.get(field)
    if value is None:
        if INSTEAD.get(endpoint) not in data:
            raise errors.BadRequestError(f"missing required parameter: '{field}'", param=field)
    elif not isinstance(value, types) or (field == "messages" and not value):
        raise errors.BadRequestError(f"'{field}' must be {what}", param=field)
    background = data.get("background")
    if background is not None and not isinstance(background, bool):
        raise errors.BadRequestError("'background' must be a boolean", param="background")
    stream = data.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise errors.BadRequestError("'stream' must be a boolean", param="stream")
    if stream and endpoint == "embeddings":
        raise errors.BadRequestError("embeddings cannot be streamed", param="stream")
    return Exchange(rid, endpoint, headers, body, data, started)
