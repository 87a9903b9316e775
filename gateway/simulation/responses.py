"""The simulated backend's Responses API: a response object, or its stream, scripted like the chat answers.

The same request gets the same text, id and usage (see `gateway.simulation.answers`); `max_output_tokens` cuts the
answer short with status `incomplete`. The stream's first group of events (response.created up to the first
output_text.delta) is due when the first token is, then one delta per token.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from gateway.simulation.answers import SSE, WORDS, Profile, Reply, _canonical, _Invalid, _length, _pick
from gateway.wire import response_events


def respond(body: dict[str, Any], model: str, profile: Profile) -> Reply:
    """The answer to a POST /responses body (raises _Invalid for what the API would refuse)."""
    given = body.get("input")
    if given is not None and not isinstance(given, (str, list)):
        raise _Invalid("'input' must be a string or an array of input items", "input")
    stream = body.get("stream") is True
    count, finish = _length(body, profile, ("max_output_tokens",))
    seed = b"responses\0" + _canonical([given, body.get("instructions"), body.get("previous_response_id")], "input")
    ident, picks = _pick(seed, count)
    words = [WORDS[pick] for pick in picks]
    text = " ".join(words)
    input_tokens = _words(given) + _words(body.get("instructions"))
    message = {
        "id": "msg_" + ident,
        "type": "message",
        "status": "completed" if finish == "stop" else "incomplete",
        "role": "assistant",
        "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": text}],
    }
    usage = {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": count,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + count,
    }
    now = int(time.time())
    response = {
        "id": "resp_" + ident,
        "object": "response",
        "created_at": now,
        "status": "completed" if finish == "stop" else "incomplete",
        "background": bool(body.get("background")),
        "completed_at": now,
        "error": None,
        "incomplete_details": None if finish == "stop" else {"reason": "max_output_tokens"},
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "model": model,
        "output": [message],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "store": body.get("store", True),
        "temperature": body.get("temperature", 1.0),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p", 1.0),
        "truncation": body.get("truncation", "disabled"),
        "usage": usage,
        "user": body.get("user"),
    }
    if not stream:
        delay = (profile.ttft_ms + profile.tpot_ms * (count - 1)) / 1000.0
        return Reply(200, b"application/json", [orjson.dumps(response)], delay, 0.0)
    deltas = [words[0], *(" " + word for word in words[1:])]
    groups = response_events.stream_events(response, [deltas])
    pieces = [b"".join(response_events.sse(event) for event in group) for group in groups]
    # The terminal group (done events and response.completed) follows the last delta at once.
    pieces[-2:] = [pieces[-2] + pieces[-1]]
    return Reply(200, SSE, pieces, profile.ttft_ms / 1000.0, profile.tpot_ms / 1000.0)


def _words(value: Any) -> int:
    """A rough token count of an input: its words, whatever the nesting of items and parts."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, dict):
        return _words(value.get("content")) + _words(value.get("text"))
    if isinstance(value, list):
        return sum(_words(item) for item in value)
    return 0
