"""Step 1 for a Messages request: the body read, parsed once, checked enough to route it, and made an Exchange.

The checks are Anthropic's own for what the gateway decides on (model, max_tokens, messages, stream); the
rest of the body is the backend's to judge, or the translation's (chat_request.py). The Exchange's endpoint is
"messages" and its body is the client's bytes, which a native backend receives unchanged.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway import errors
from gateway.context import Exchange
from gateway.server import request

MESSAGES = "messages"
COUNT_TOKENS = "messages/count_tokens"
ROLES = ("user", "assistant", "system")  # a system turn within the conversation: Claude Code sends them


def parse(
    endpoint: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    started: float,
    rid: str,
    path_model: str | None = None,
) -> Exchange:
    """The Exchange of a Messages (or count_tokens) request, or a GatewayError with a 400 the client can act on.
    (`path_model`: this API names no model in its paths.)"""
    try:
        data: Any = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise errors.BadRequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise errors.BadRequestError("request body must be a JSON object")
    if body.count(b"{") + body.count(b"[") > request.MAX_DEPTH and request.too_deep(data, request.MAX_DEPTH):
        raise errors.BadRequestError(f"request body nests arrays and objects deeper than {request.MAX_DEPTH} levels")
    twice = request.repeated(body, data)
    if twice is not None:
        raise errors.BadRequestError(f"{twice}: the field appears more than once in the request body", param=twice)
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise errors.BadRequestError("model: Field required", param="model")
    messages = data.get("messages")
    if not isinstance(messages, list):
        raise errors.BadRequestError("messages: Field required (an array of messages)", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise errors.BadRequestError(
                f"messages.{index}: each message must be an object with role 'user', 'assistant' or 'system'",
                param=f"messages.{index}",
            )
        content = message.get("content")
        if not isinstance(content, (str, list)):
            raise errors.BadRequestError(
                f"messages.{index}.content: must be a string or an array of content blocks",
                param=f"messages.{index}.content",
            )
    if endpoint == MESSAGES:
        if not messages:
            raise errors.BadRequestError("messages: at least one message is required", param="messages")
        limit = data.get("max_tokens")
        if type(limit) is not int or limit < 1:
            raise errors.BadRequestError("max_tokens: Field required (a positive integer)", param="max_tokens")
        stream = data.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise errors.BadRequestError("stream: Input should be a valid boolean", param="stream")
    else:
        data.pop("stream", None)  # counting never streams
        # What a count costs the rate limiter: its prompt's estimate and one token, not a default completion.
        # (The body a native backend receives is the client's, without it.)
        data["max_tokens"] = 1
    system = data.get("system")
    if system is not None and not isinstance(system, (str, list)):
        raise errors.BadRequestError("system: must be a string or an array of text blocks", param="system")
    ex = Exchange(rid, endpoint, headers, body, data, started)
    ex.include_usage = True  # a Messages stream always carries its usage: nothing to ask for or hide
    return ex
