"""A scripted mix of poor answers, for testing and measuring what judges an answer (the cascade plugin).

A simulated backend configured with `failures: {empty: 0.1, json: 0.05}` answers that share of whole chat
completions badly, each in one way a check can see: empty content (`empty`), cut by its token limit
(`length`), invalid JSON where a JSON response format was asked for (`json`), a tool call whose arguments do
not parse (`tool_args`), or low token log-probabilities (`logprob`). Which request fails, and how, is picked
by a hash of its messages, as everything else the simulator says: the same request always gets the same
answer, and over many different requests the shares hold.

A backend with a mix (even of zero shares) shapes its good answers to pass the same checks: JSON content
when a JSON response format is asked for, a tool call when tools are given,
token log-probabilities near zero when `logprobs` is asked for.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

KINDS = ("empty", "length", "json", "tool_args", "logprob")
GOOD_LOGPROB = -0.05
POOR_LOGPROB = -4.0


def pick(mix: tuple[tuple[str, float], ...], seed: bytes) -> str | None:
    """The failure this request gets under `mix` ((kind, share) pairs), or None: a good answer."""
    if not mix:
        return None
    draw = int.from_bytes(hashlib.blake2b(seed, digest_size=8, person=b"sluice-fault").digest(), "big") / 2.0**64
    edge = 0.0
    for kind, share in mix:
        edge += share
        if draw < edge:
            return kind
    return None


def shape(body: dict[str, Any], choice: dict[str, Any], words: list[str], fault: str | None) -> None:
    """Make `choice` (a whole chat completion's, content set to the words' text) the answer the request asked
    for, spoiled as `fault` says."""
    message = choice["message"]
    text: str = message["content"]
    wants_json = _wants_json(body)
    if wants_json:
        message["content"] = orjson.dumps({"answer": text}).decode()
    tools = body.get("tools")
    if isinstance(tools, list) and tools and body.get("tool_choice") != "none":
        name = ((tools[0] or {}).get("function") or {}).get("name", "tool") if isinstance(tools[0], dict) else "tool"
        arguments = orjson.dumps({"query": text}).decode()
        if fault == "tool_args":
            arguments = arguments[: len(arguments) // 2]
        call = {"id": "call_" + hashlib.sha1(text.encode()).hexdigest()[:24], "type": "function",
                "function": {"name": name, "arguments": arguments}}  # fmt: skip
        message["content"] = None
        message["tool_calls"] = [call]
        choice["finish_reason"] = "tool_calls"
    if fault == "empty":
        message["content"] = ""
        message.pop("tool_calls", None)
        choice["finish_reason"] = "stop"
    elif fault == "length":
        content = message.get("content") or text
        message["content"] = content[: max(1, len(content) // 2)]
        message.pop("tool_calls", None)
        choice["finish_reason"] = "length"
    elif fault == "json" and wants_json and isinstance(message["content"], str):
        message["content"] = message["content"][:-2]  # the closing quote and brace lost
    if body.get("logprobs") is True:
        value = POOR_LOGPROB if fault == "logprob" else GOOD_LOGPROB
        tokens: list[dict[str, Any]] = [
            {"token": w, "logprob": value, "bytes": None, "top_logprobs": []} for w in words
        ]
        choice["logprobs"] = {"content": tokens, "refusal": None}


def _wants_json(body: dict[str, Any]) -> bool:
    form = body.get("response_format")
    return isinstance(form, dict) and form.get("type") in ("json_object", "json_schema")
