"""What marks a stream's first token, its usage and its end, per endpoint: seen with a regex, never parsed.

The relay (server/relay.py) and the attempt loop's first-token deadline (upstream/attempts.py) both read a
stream by these marks, so they live here, below both.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

# The first chunk that carries output: text, a tool call or its arguments. Azure's preamble (empty
# choices, prompt_filter_results) and the role-only first delta do not match.
FIRST_TOKEN = re.compile(
    rb'"(?:content|text|arguments|reasoning_content|reasoning|refusal)":\s*"[^"]|"tool_calls":\s*\[\s*\{'
)
USAGE_KEY = b'"usage":'
SPACE = b" \t\r\n"
BRACE = ord("{")
DONE = b"data: [DONE]"
DONE_MARK = re.compile(re.escape(DONE))
USAGE_EVENT = re.compile(rb'"choices":\s*\[\s*\]')
USAGE_OPEN = b'"usage":{'
USAGE_OPEN_SPACED = b'"usage": {'
NULL_USAGE = b',"usage":null'
NULL_USAGE_SPACED = b', "usage": null'


@dataclass(frozen=True, slots=True)
class StreamRules:
    """How to see an endpoint's first token and its end without parsing its events."""

    first_token: re.Pattern[bytes]
    end: re.Pattern[bytes]
    end_name: str  # for the error when it is missing


CHAT_RULES = StreamRules(FIRST_TOKEN, DONE_MARK, "[DONE]")
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


# Anthropic's Messages streams: the first output is a content block's delta (text, a tool's input, thinking), and
# the stream ends with message_stop.
MESSAGES_RULES = StreamRules(re.compile(rb"content_block_delta"), re.compile(rb"message_stop"), "message_stop")
RULES = {"responses": RESPONSES_RULES, "messages": MESSAGES_RULES, "messages/count_tokens": MESSAGES_RULES}


def stream_rules(endpoint: str) -> StreamRules:
    return RULES.get(endpoint, CHAT_RULES)


def usages(data: bytes, start: int = 0) -> Iterator[tuple[int, int, int]]:
    """Each `"usage":{...}` member in `data` from `start`, left to right: (where its name starts, where its
    object starts, where it ends). Found with bytes.find rather than a regex, whose per-character alternation
    over the object cost 4 us a whole answer here, 16 us with OpenAI's token-details objects.

    Usage objects hold numbers and objects of numbers, so the braces are counted without reading strings.
    """
    at = data.find(USAGE_KEY, start)
    while at >= 0:
        span = usage_at(data, at)
        if span is not None:
            yield at, span[0], span[1]
            at = data.find(USAGE_KEY, span[1])
        else:
            at = data.find(USAGE_KEY, at + len(USAGE_KEY))


def last_usage(data: bytes) -> tuple[int, int] | None:
    """The last usage object in `data` (an answer's or a stream's tail): (where it starts, where it ends)."""
    at = data.rfind(USAGE_KEY)
    while at >= 0:
        span = usage_at(data, at)
        if span is not None:
            return span
        at = data.rfind(USAGE_KEY, 0, at)
    return None


def usage_at(data: bytes, at: int) -> tuple[int, int] | None:
    """The object of the `"usage":` member at `at`, if one follows it whole: (where it starts, where it ends)."""
    opening = at + len(USAGE_KEY)
    size = len(data)
    while opening < size and data[opening] != BRACE:
        if data[opening] not in SPACE:
            return None  # null, or not an object
        opening += 1
    if opening >= size:
        return None
    end = _object_end(data, opening)
    return (opening, end) if end > 0 else None


def _object_end(data: bytes, opening: int) -> int:
    """Where the object whose `{` is at `opening` ends (after its `}`), or -1 if it does not end in `data`: the
    first `}` after which as many braces have closed as opened. Each step finds the next `}` and counts the `{`
    since the last one, so every byte is read twice at most (a flat object: one find and one count)."""
    depth = 1
    start = opening + 1
    while True:
        close = data.find(b"}", start)
        if close < 0:
            return -1
        depth += data.count(b"{", start, close) - 1
        start = close + 1
        if depth <= 0:
            return start
