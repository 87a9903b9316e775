"""The relay: upstream bytes to the client as they arrive, unchanged, one ASGI message per chunk.

It watches the SSE framing cheaply instead of parsing it: a regex over each chunk only until the first
token has been seen, then nothing per chunk but a clock read; usage and `[DONE]` are looked for once, in
the last two chunks. A failure after the first byte cannot change the status any more, so it becomes one
`data: {"error": ...}` event and `data: [DONE]`: the client always learns that the answer is incomplete.

Usage for every stream: upstreams are asked for it (`stream_options.include_usage`, see
providers/http.py) even when the client did not ask, and for such a client the relay hides it again
(HIDE). Usage comes in one of two shapes: a usage-only chunk (`"choices":[]` and a usage object, the last
event before `[DONE]`, or one per choice for llama.cpp's `n > 1`), which is cut out; or, as TGI 2.3 to 3.1
send it, a usage object on the last content chunk (the one with the finish reason), which is cut from that
chunk, the chunk kept. The `"usage":null` every other chunk then carries is removed. To do that without
parsing chunks, the relay holds back only an unfinished event at the end of a read (a client cannot use
half an event anyway) and looks for `"usage":{` in what it sends: a substring test per read, the regex
and the parse only for the event that has one. An upstream that cannot report usage (COUNT) has its
events counted instead, and the outcome says the tokens are estimated.

Several usage-only chunks (llama.cpp streams one per choice) are summed: completion tokens added, the
prompt counted once. A usage on a content chunk is cumulative (TGI's, vLLM's continuous usage): the last
one counts. A client that asked for usage (PASS) gets the stream unchanged; its usage is read from the tail,
or for `n > 1` from every event that has one, since a choice that ends early sends its usage mid-stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import orjson

from gateway import errors
from gateway.plugin import Outcome, Tap
from gateway.upstream.connection import PoolError, ReadTimeout
from gateway.wire.marks import (
    CHAT_RULES,
    MESSAGES_RULES,
    NULL_USAGE,
    NULL_USAGE_SPACED,
    SPACE,
    USAGE_EVENT,
    USAGE_OPEN,
    USAGE_OPEN_SPACED,
    StreamRules,
    last_usage,
    usages,
)

if TYPE_CHECKING:
    from starlette.types import Send

    from gateway.upstream.providers.base import UpstreamResponse

# What the relay does about usage: pass the stream as it is (the client asked for usage), hide the usage
# the upstream was asked for, or count events because the upstream cannot report it.
PASS, HIDE, COUNT = 0, 1, 2

Found = Sequence[tuple[dict[str, Any], bool]]  # usage objects, and whether each had a chunk of its own
NOTHING: Found = ()
COMMA = ord(",")


def find_usage(data: bytes) -> dict[str, Any] | None:
    """The last usage object in `data` (an SSE tail or a whole JSON body), if any."""
    span = last_usage(data)
    if span is None:
        return None
    usage = _usage_object(data[span[0] : span[1]])
    return counted(usage) if usage is not None else None


def counted(usage: dict[str, Any]) -> dict[str, Any]:
    """`usage` with the chat names added, so that every reader of usage sees one shape.

    The Responses API counts cached tokens in `input_tokens` and says `total_tokens`; Anthropic's Messages API
    counts the prompt in three parts (`input_tokens` not cached, `cache_read_input_tokens`,
    `cache_creation_input_tokens`) and says no total.
    """
    if "prompt_tokens" in usage or not ("input_tokens" in usage or "output_tokens" in usage):
        return usage
    if "total_tokens" in usage:
        usage["prompt_tokens"] = usage.get("input_tokens")
        usage["completion_tokens"] = usage.get("output_tokens")
        return usage
    parts = (usage.get(key) for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
    prompt = sum(part for part in parts if type(part) is int)
    output = usage.get("output_tokens")
    usage["prompt_tokens"] = prompt
    if type(output) is int:
        usage["completion_tokens"] = output
        usage["total_tokens"] = prompt + output
    return usage


def messages_usage(first: bytes, tail: bytes) -> dict[str, Any] | None:
    """A Messages stream's usage: message_start's (the prompt), updated by the last message_delta's (the output;
    Anthropic's API repeats the prompt there, llama.cpp's does not)."""
    merged: dict[str, Any] = {}
    for _, opening, closing in usages(first):
        merged.update(_usage_object(first[opening:closing]) or {})
        break
    span = last_usage(tail)
    if span is not None:
        merged.update(_usage_object(tail[span[0] : span[1]]) or {})
    return counted(merged) if merged else None


def all_choices_usage(body: bytes, usage: dict[str, Any]) -> dict[str, Any]:
    """A whole answer's usage when the upstream counted its first choice only (llama.cpp with `n > 1`).

    The other choices' completion tokens are estimated in proportion to their text (the first one's count
    times the ratio of lengths; times the number of choices when the first is empty). Parses the body: only
    requests with `n > 1` to such an upstream come here.
    """
    completion = usage.get("completion_tokens")
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return usage
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(completion, int) or not isinstance(choices, list) or len(choices) < 2:
        return usage
    lengths = [len(_choice_text(choice)) for choice in choices]
    first = lengths[0]
    estimate = round(completion * sum(lengths) / first) if first else completion * len(choices)
    estimated = {**usage, "completion_tokens": estimate}
    prompt = usage.get("prompt_tokens")
    if isinstance(prompt, int):
        estimated["total_tokens"] = prompt + estimate
    return estimated


def _choice_text(choice: Any) -> str:
    if not isinstance(choice, dict):
        return ""
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    return text if isinstance(text, str) else ""


def usage_mode(include_usage: bool, reports_usage: bool) -> int:
    """PASS, HIDE or COUNT for a stream whose client did or did not ask for usage."""
    if include_usage:
        return PASS
    return HIDE if reports_usage else COUNT


class Tally:
    """The usage a stream has reported so far: usage-only chunks summed (one per choice), the last inline one."""

    __slots__ = ("inline", "summed")

    def __init__(self) -> None:
        self.summed: dict[str, Any] | None = None
        self.inline: dict[str, Any] | None = None

    def add(self, usage: dict[str, Any], alone: bool) -> None:
        if not alone:
            self.inline = usage  # cumulative: the last one is the whole
        elif self.summed is None:
            self.summed = usage
        else:
            self.summed = add_choice(self.summed, usage)

    @property
    def usage(self) -> dict[str, Any] | None:
        return self.summed if self.summed is not None else self.inline


def add_choice(total: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """`total` with another choice's usage added: its completion tokens; the prompt is the same one, counted once."""
    done, extra = total.get("completion_tokens"), more.get("completion_tokens")
    if not (isinstance(done, int) and isinstance(extra, int)):
        return total
    summed = {**total, "completion_tokens": done + extra}
    prompt = total.get("prompt_tokens")
    if isinstance(prompt, int):
        summed["total_tokens"] = prompt + done + extra
    return summed


def hide_usage(data: bytes, cut: bool = True) -> tuple[bytes, bytes, Found]:
    """(what to send now, what to hold back, the usage found) for the stream read so far.

    Everything up to the last complete event goes now; an unfinished event waits for the next read. Each usage
    among the complete events is returned with whether its chunk was usage-only; with `cut`, a usage-only chunk
    is cut out, a usage on a content chunk cut from it (the chunk kept), and `"usage":null` removed.
    """
    if data.endswith(b"\n\n") or data.endswith(b"\r\n\r\n"):
        out, held = data, b""
    else:
        lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        out, held = data[:end], data[end:]
    found: Found = NOTHING
    # A substring search per read (find: `in` on bytes first tries the operand as an int, ~1k instructions
    # more each time); the rest only here.
    if out.find(USAGE_OPEN) >= 0 or out.find(USAGE_OPEN_SPACED) >= 0:
        out, found = _take_usage(out, cut)
    if cut:  # replace() gives the same object back when there is nothing to replace: no copy
        out = out.replace(NULL_USAGE, b"").replace(NULL_USAGE_SPACED, b"")
    return out, held, found


def _take_usage(out: bytes, cut: bool) -> tuple[bytes, Found]:
    """The usage objects in complete events `out`, and `out` without them (with `cut`)."""
    found = []
    kept = []
    at = 0
    for name, opening, closing in usages(out):
        start = out.rfind(b"data:", at, name)
        end = _event_end(out, closing)
        usage = _usage_object(out[opening:closing]) if start >= 0 and end > 0 else None
        if usage is None:
            continue
        alone = USAGE_EVENT.search(out, start, end) is not None  # `"choices":[]`, before or after it
        found.append((usage, alone))
        if not cut:
            continue
        if alone:
            kept.append(out[at:start])
        else:
            # The member and one comma beside it: `,"usage":{...}` as usage is usually last, else `"usage":{...},`.
            left, right = name, closing
            before = left
            while before > start and out[before - 1] in SPACE:
                before -= 1
            if out[before - 1] == COMMA:
                left = before - 1
            else:
                after = right
                while after < end and out[after] in SPACE:
                    after += 1
                if out[after] == COMMA:
                    right = after + 1
            kept.append(out[at:left])
            end = right
        at = end
    if at:
        kept.append(out[at:])
        out = b"".join(kept)
    return out, found


def _usage_object(raw: bytes) -> dict[str, Any] | None:
    try:
        usage = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return usage if isinstance(usage, dict) else None


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
    choices: int = 1,
) -> None:
    """Pass an SSE body through; fill in `outcome` (TTFT, TPOT, usage, completeness) as it goes.

    `choices`: the request's `n`, when it asked for more than one.
    """
    chunk = first
    prev = prev2 = held = b""
    last_at = 0.0
    chunks = events = 0
    tally = Tally()
    # n > 1: a choice that ends early may send its usage chunk mid-stream, so every event is looked at.
    scan = usage_mode == HIDE or (usage_mode == PASS and choices > 1)
    broke: PoolError | None = None  # the transport error that ended the stream, if one did
    try:
        while chunk:
            chunks += 1
            if not first_token_at and rules.first_token.search(chunk):
                first_token_at = time.perf_counter()
            out = chunk
            if scan:
                cut = usage_mode == HIDE
                seen, held, found = hide_usage(held + chunk if held else chunk, cut)
                if cut:
                    out = seen
                for usage, alone in found:
                    tally.add(usage, alone)
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
        outcome.error = f"{type(exc).__name__}: {exc}"  # for the log; the client is told less (below)
        broke = exc
    except asyncio.CancelledError:
        tail = prev2[-2048:] + prev
        if rules.end.search(tail) or rules.end.search(prev2):
            # The client left after the end mark had gone out, before the stream's last (empty) chunk: the
            # openai SDK closes the connection at [DONE]. It has the whole answer, so the stream is complete
            # and its usage counts, as if it had ended.
            outcome.complete = True
            for tap in taps:
                tap(b"")
            account(outcome, tally.usage if scan else find_usage(tail), chunks, events, usage_mode, choices)
            timing(outcome, started, first_token_at, last_at or time.perf_counter(), choices)
        raise
    # Usage comes in the last event before [DONE]; upstreams often send the two as separate chunks.
    tail = prev2[-2048:] + prev
    # A Responses stream's terminal event holds the whole response and may span both chunks: look at all of it.
    await end(send, outcome, rules, tail, prev2, broke, held if usage_mode == HIDE else b"", taps)
    final = tally.usage if scan else find_usage(tail)
    if rules is MESSAGES_RULES:  # the prompt's count comes in the first event, the output's in the last
        final = messages_usage(first, tail)
    account(outcome, final, chunks, events, usage_mode, choices)
    timing(outcome, started, first_token_at, last_at, choices)


async def end(
    send: Send,
    outcome: Outcome,
    rules: StreamRules,
    tail: bytes,
    prev2: bytes,
    broke: PoolError | None,
    held: bytes,
    taps: tuple[Tap, ...],
) -> None:
    """A relayed stream's last words: complete if its end mark went out, else the gateway's error event."""
    if outcome.error is None and not (rules.end.search(tail) or rules.end.search(prev2)):
        outcome.error = f"upstream stream ended without {rules.end_name}"
    if outcome.error is not None:
        if broke is None:  # ended early without a transport error: the gateway's own finding, said as it is
            said = outcome.error
        else:
            said = "the upstream went silent" if isinstance(broke, ReadTimeout) else "the upstream connection was cut"
        event = errors.UpstreamError(f"upstream stream failed: {said}").sse_event()
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


def account(outcome: Outcome, usage: dict[str, Any] | None, chunks: int, events: int, mode: int, choices: int) -> None:
    """A stream's chunks and usage in `outcome`: as reported, or estimated from its events (COUNT)."""
    outcome.chunks = chunks
    outcome.usage = usage
    if usage is None and mode == COUNT and events > 2:
        # Every event but the finish chunk and [DONE] roughly one token; no total, so nothing is corrected
        # by it (the rate limiter keeps its estimate).
        outcome.usage = {"completion_tokens": events - 2}
        outcome.usage_source = "estimated"


def timing(outcome: Outcome, started: float, first_token_at: float, last_at: float, choices: int) -> None:
    """A stream's TTFT and TPOT in `outcome`, once its usage is known."""
    if first_token_at:
        outcome.ttft_ms = (first_token_at - started) * 1000.0
        tokens = (outcome.usage or {}).get("completion_tokens")
        if isinstance(tokens, int) and choices > 1:
            tokens //= choices  # the choices are generated side by side
        if isinstance(tokens, int) and tokens > 1 and last_at > first_token_at:
            outcome.tpot_ms = (last_at - first_token_at) * 1000.0 / (tokens - 1)
