"""The relay: upstream bytes to the client as they arrive, unchanged, one ASGI message per chunk.

It watches the SSE framing cheaply instead of parsing it: a regex over each chunk only until the first
token has been seen, then nothing per chunk but a clock read; usage and `[DONE]` are looked for once, in
the last two chunks. A failure after the first byte cannot change the status any more, so it becomes one
`data: {"error": ...}` event and `data: [DONE]`: the client always learns that the answer is incomplete.

Usage for every stream: upstreams are asked for it (`stream_options.include_usage`, see
providers/http.py) even when the client did not ask, and for such a client the relay hides it again
(HIDE): the usage-only chunk (`"choices":[]` and a usage object, the last event before `[DONE]`) is cut
out and the `"usage":null` every other chunk then carries is removed. To do that without parsing chunks,
the relay holds back only an unfinished event at the end of a read (a client cannot use half an event
anyway) and looks for `[]` in what it sends. An upstream that cannot report usage (COUNT) has its events
counted instead, and the outcome says the tokens are estimated.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import orjson

from gateway import errors
from gateway.plugin import Outcome, Tap
from gateway.upstream.pool import PoolError
from gateway.wire.marks import (
    CHAT_RULES,
    NULL_USAGE,
    NULL_USAGE_SPACED,
    USAGE,
    USAGE_EVENT,
    StreamRules,
)

if TYPE_CHECKING:
    from starlette.types import Send

    from gateway.upstream.providers.base import UpstreamResponse

# What the relay does about usage: pass the stream as it is (the client asked for usage), hide the usage
# the upstream was asked for, or count events because the upstream cannot report it.
PASS, HIDE, COUNT = 0, 1, 2


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


def usage_mode(include_usage: bool, reports_usage: bool) -> int:
    """PASS, HIDE or COUNT for a stream whose client did or did not ask for usage."""
    if include_usage:
        return PASS
    return HIDE if reports_usage else COUNT


def hide_usage(data: bytes) -> tuple[bytes, bytes, dict[str, Any] | None]:
    """(what to send now, what to hold back, the usage found) for the stream read so far.

    Everything up to the last complete event goes now; an unfinished event waits for the next read. A usage
    chunk among the complete events is cut out and its usage returned.
    """
    if data.endswith(b"\n\n") or data.endswith(b"\r\n\r\n"):
        out, held = data, b""
    else:
        lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
        cut = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        out, held = data[:cut], data[cut:]
    usage = None
    if b"[]" in out:  # a usage chunk has empty choices; content can hold "[]" too, so look closer
        found = None
        for found in USAGE_EVENT.finditer(out):  # noqa: B007 - the last match is the one wanted
            pass
        if found is not None:
            start = out.rfind(b"data:", 0, found.start())
            end = _event_end(out, found.end())
            if start >= 0 and end > 0:
                usage = find_usage(out[start:end])
                if usage is not None:
                    out = out[:start] + out[end:]
    if NULL_USAGE in out:
        out = out.replace(NULL_USAGE, b"")
    if NULL_USAGE_SPACED in out:
        out = out.replace(NULL_USAGE_SPACED, b"")
    return out, held, usage


def _event_end(data: bytes, at: int) -> int:
    """Where the event holding position `at` ends (after its blank line); 0 if it does not end in `data`."""
    lf = data.find(b"\n\n", at)
    if lf >= 0:
        return lf + 2
    crlf = data.find(b"\r\n\r\n", at)
    return crlf + 4 if crlf >= 0 else 0


async def relay_stream(
    send: Send,
    response: UpstreamResponse,
    first: bytes,
    outcome: Outcome,
    taps: tuple[Tap, ...],
    started: float,
    first_token_at: float = 0.0,
    usage_mode: int = PASS,
    rules: StreamRules = CHAT_RULES,
) -> None:
    """Pass an SSE body through; fill in `outcome` (TTFT, TPOT, usage, completeness) as it goes."""
    chunk = first
    prev = prev2 = held = b""
    last_at = 0.0
    chunks = events = 0
    usage = None
    try:
        while chunk:
            chunks += 1
            if not first_token_at and rules.first_token.search(chunk):
                first_token_at = time.perf_counter()
            out = chunk
            if usage_mode == HIDE:
                out, held, found = hide_usage(held + chunk if held else chunk)
                if found is not None:
                    usage = found
            elif usage_mode == COUNT:
                events += chunk.count(b"data:")
            if out:
                for tap in taps:
                    tap(out)
            if out or chunks == 1:  # the first send carries the response head too (protocol.py's BODY_FOLLOWS)
                await send({"type": "http.response.body", "body": out, "more_body": True})
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
        if held:  # an unfinished last event: passed on as the upstream sent it
            for tap in taps:
                tap(held)
            await send({"type": "http.response.body", "body": held, "more_body": True})
        for tap in taps:
            tap(b"")
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    outcome.chunks = chunks
    outcome.usage = usage if usage_mode == HIDE else find_usage(tail)
    if outcome.usage is None and usage_mode == COUNT and events > 2:
        # Every event but the finish chunk and [DONE] roughly one token; no total, so nothing is corrected
        # by it (the rate limiter keeps its estimate).
        outcome.usage = {"completion_tokens": events - 2}
        outcome.usage_source = "estimated"
    if first_token_at:
        outcome.ttft_ms = (first_token_at - started) * 1000.0
        tokens = (outcome.usage or {}).get("completion_tokens")
        if isinstance(tokens, int) and tokens > 1 and last_at > first_token_at:
            outcome.tpot_ms = (last_at - first_token_at) * 1000.0 / (tokens - 1)
