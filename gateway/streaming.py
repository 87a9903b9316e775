"""The relay: upstream bytes to the client as they arrive, unchanged, one ASGI message per chunk.

It watches the SSE framing cheaply instead of parsing it: a regex over each chunk only until the first
token has been seen, then nothing per chunk but a clock read; usage and `[DONE]` are looked for once, in
the last two chunks. A failure after the first byte cannot change the status any more, so it becomes one
`data: {"error": ...}` event and `data: [DONE]`: the client always learns that the answer is incomplete.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from gateway import errors
from gateway.plugin import Outcome, Tap
from gateway.pool import PoolError

if TYPE_CHECKING:
    from starlette.types import Send

    from gateway.providers.base import UpstreamResponse

# The first chunk that carries output: text, a tool call or its arguments. Azure's preamble (empty
# choices, prompt_filter_results) and the role-only first delta do not match.
FIRST_TOKEN = re.compile(
    rb'"(?:content|text|arguments|reasoning_content|reasoning|refusal)":\s*"[^"]|"tool_calls":\s*\[\s*\{'
)
USAGE = re.compile(rb'"usage":\s*(\{(?:[^{}]|\{[^{}]*\})*\})')
DONE = re.compile(rb"data: \[DONE\]")


@dataclass(frozen=True, slots=True)
class StreamRules:
    """How to see an endpoint's first token and its end without parsing its events."""

    first_token: re.Pattern[bytes]
    end: re.Pattern[bytes]
    end_name: str  # for the error when it is missing


CHAT_RULES = StreamRules(FIRST_TOKEN, DONE, "[DONE]")
# Responses streams name every event's type; the first output is a delta of text, a refusal, a tool call's
# arguments or reasoning, and the stream ends with its terminal event rather than [DONE].
RESPONSES_RULES = StreamRules(
    re.compile(
        rb"response\.(?:output_text|refusal|function_call_arguments|custom_tool_call_input|reasoning_text"
        rb"|reasoning_summary_text|audio_transcript|audio|code_interpreter_call_code)\.delta"
    ),
    re.compile(rb"response\.(?:completed|incomplete|failed)\b"),
    "response.completed",
)


def stream_rules(endpoint: str) -> StreamRules:
    return RESPONSES_RULES if endpoint == "responses" else CHAT_RULES


def find_usage(data: bytes) -> dict[str, Any] | None:
    """The last usage object in `data` (an SSE tail or a whole JSON body), if any."""
    found = None
    for found in USAGE.finditer(data):  # noqa: B007 - the last match is the one wanted
        pass
    if found is None:
        return None
    try:
        usage = orjson.loads(found.group(1))
    except orjson.JSONDecodeError:
        return None
    if not isinstance(usage, dict):
        return None
    if "input_tokens" in usage and "prompt_tokens" not in usage:
        # The Responses API's names; the chat names are added so that every reader of usage sees one shape.
        usage["prompt_tokens"] = usage["input_tokens"]
        usage["completion_tokens"] = usage.get("output_tokens")
    return usage


async def relay_stream(
    send: Send,
    response: UpstreamResponse,
    first: bytes,
    outcome: Outcome,
    taps: tuple[Tap, ...],
    started: float,
    first_token_at: float = 0.0,
    rules: StreamRules = CHAT_RULES,
) -> None:
    """Pass an SSE body through; fill in `outcome` (TTFT, TPOT, usage, completeness) as it goes."""
    chunk = first
    prev = prev2 = b""
    last_at = 0.0
    chunks = 0
    try:
        while chunk:
            chunks += 1
            if not first_token_at and rules.first_token.search(chunk):
                first_token_at = time.perf_counter()
            for tap in taps:
                tap(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            prev2, prev = prev, chunk
            chunk = await response.next_chunk()
            last_at = time.perf_counter()
    except PoolError as exc:
        outcome.error = str(exc)
    # Usage comes in the last event before [DONE]; upstreams often send the two as separate chunks.
    tail = prev2[-2048:] + prev
    # A Responses stream's terminal event holds the whole response and may span both chunks: look at all of it.
    if outcome.error is None and not (rules.end.search(tail) or rules.end.search(prev2)):
        outcome.error = f"upstream stream ended without {rules.end_name}"
    if outcome.error is not None:
        event = errors.UpstreamError(f"upstream stream failed: {outcome.error}").sse_event()
        for tap in taps:
            tap(b"")
        await send({"type": "http.response.body", "body": event, "more_body": False})
    else:
        outcome.complete = True
        for tap in taps:
            tap(b"")
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    outcome.chunks = chunks
    outcome.usage = find_usage(tail)
    if first_token_at:
        outcome.ttft_ms = (first_token_at - started) * 1000.0
        tokens = (outcome.usage or {}).get("completion_tokens")
        if isinstance(tokens, int) and tokens > 1 and last_at > first_token_at:
            outcome.tpot_ms = (last_at - first_token_at) * 1000.0 / (tokens - 1)
