"""The checks a small model's whole chat answer must pass, and the answer made fit to send.

`verdict` returns None for an answer that passes, else the first check it fails: "empty" (no content and no
tool call), "length" (cut by its token limit), "json" (not a JSON object where the request asked for a JSON
response format), "tool_args" (a tool call whose arguments are not a JSON object), "logprob" (mean token
log-probability below the bound, or none reported), "invalid" (not a chat completion at all).
"""

from __future__ import annotations

from typing import Any

import orjson

from plugins.cascade.config import CascadeSpec


def wants_json(request: dict[str, Any]) -> bool:
    form = request.get("response_format")
    return isinstance(form, dict) and form.get("type") in ("json_object", "json_schema")


def verdict(document: Any, request: dict[str, Any], spec: CascadeSpec) -> str | None:
    choices = document.get("choices") if isinstance(document, dict) else None
    if not isinstance(choices, list) or not choices:
        return "invalid"
    checks = spec.checks
    for choice in choices:
        if not isinstance(choice, dict):
            return "invalid"
        message = choice.get("message")
        if not isinstance(message, dict):
            return "invalid"
        content = message.get("content")
        calls = message.get("tool_calls")
        if "length" in checks and choice.get("finish_reason") == "length":
            return "length"
        if "empty" in checks and not calls and not (isinstance(content, str) and content.strip()):
            return "empty"
        if "tool_args" in checks and calls and not all(_parses(call) for call in calls):
            return "tool_args"
        if "json" in checks and isinstance(content, str) and wants_json(request) and not _json_object(content):
            return "json"
        if spec.min_mean_logprob is not None and _mean_logprob(choice) < spec.min_mean_logprob:
            return "logprob"
    return None


def without_logprobs(document: dict[str, Any]) -> bytes:
    """The answer as the client asked for it: without the log-probabilities asked for on its behalf."""
    for choice in document.get("choices") or ():
        if isinstance(choice, dict):
            choice["logprobs"] = None
    return orjson.dumps(document)


def _parses(call: Any) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    return isinstance(arguments, str) and _json_object(arguments)


def _json_object(text: str) -> bool:
    try:
        return isinstance(orjson.loads(text), dict)
    except orjson.JSONDecodeError:
        return False


def _mean_logprob(choice: dict[str, Any]) -> float:
    logprobs = choice.get("logprobs")
    tokens = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(tokens, list) or not tokens:
        return float("-inf")  # nothing to judge by: the answer cannot show it is confident
    values = [t.get("logprob") for t in tokens if isinstance(t, dict)]
    numbers = [v for v in values if isinstance(v, int | float)]
    return sum(numbers) / len(numbers) if numbers else float("-inf")
