"""Deterministic OpenAI-compatible answers, as bytes, for the simulated upstream.

The same request always gets the same text (words picked by a hash of the prompt), the same id and the same
usage, so caches, tests and benchmarks can rely on it. Nothing here does I/O or keeps state: `simulate`
scripts a whole reply up front, and whoever plays it applies the delays: the in-process backend
(`gateway.upstream.providers.simulated`), the standalone server (`tools.sim`) and the stand-ins for vLLM, TGI,
llama.cpp and Ollama (`tools/sim/`), which pace it with their replica model instead.

`sse` is the one Server-Sent Events writer: every streamed event of every simulated server is framed by it.
`chat_tokens` is the simulated tokenizer: one token per whitespace-separated word of a message's text, plus 4
tokens of chat framing per message, so `len(chat_tokens(messages))` is the `prompt_tokens` that usage reports.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
import time
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.simulation import faults
from gateway.wire.completion import DONE_EVENT as DONE
from gateway.wire.completion import sse

JSON = b"application/json"
SSE = b"text/event-stream"


_SLOT = b"\0"  # where a token goes in an event template

# 64 words, so that one hash byte picks one word with `& 63`.
WORDS = (
    "the", "gateway", "keeps", "latency", "low", "and", "every", "token", "flows", "through", "a", "quiet",
    "river", "of", "bytes", "while", "models", "think", "about", "light", "stone", "water", "gently", "fast",
    "clear", "signal", "under", "open", "sky", "with", "small", "steps", "toward", "bright", "morning", "calm",
    "answer", "begins", "here", "now", "again", "simple", "honest", "work", "moves", "forward", "each", "day",
    "beneath", "green", "hills", "where", "streams", "meet", "wide", "sea", "soft", "wind", "carries", "news",
    "from", "far", "away", "home",
)  # fmt: skip
# Tokens as they appear in the text (all but the first carry a leading space), already JSON-encoded for the
# stream templates, so a streamed token costs a join and no serialisation.
_FIRST_JSON = tuple(orjson.dumps(word) for word in WORDS)
_NEXT_JSON = tuple(orjson.dumps(" " + word) for word in WORDS)
_ID_BYTES = 12
_MAX_DIMENSIONS = 8192


@dataclass(frozen=True, slots=True)
class Profile:
    """How the simulated model behaves."""

    ttft_ms: float = 150.0  # request -> first streamed event
    tpot_ms: float = 15.0  # between streamed events
    tokens: int = 16  # answer length unless max_tokens cuts it
    embedding_dim: int = 8
    # A scripted share of poor whole chat answers, as (kind, share) pairs (gateway/simulation/faults.py).
    failures: tuple[tuple[str, float], ...] = ()


@dataclass(slots=True)
class Reply:
    """A scripted answer: piece i is due `ttft_s + i * tpot_s` after the request.

    A stream's pieces are SSE events ending with `data: [DONE]`. Any other reply is one piece, the whole body,
    whose `ttft_s` already includes the simulated generation time (`tpot_s` is then 0).
    """

    status: int
    content_type: bytes
    pieces: list[bytes]
    ttft_s: float
    tpot_s: float
    tokens: int = 0  # tokens generated; a chat stream's token events follow its role event
    text: str = ""  # what was generated (chat and completions), for a replica model that caches it

    @property
    def stream(self) -> bool:
        return self.content_type == SSE


class _Invalid(Exception):
    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def simulate(
    endpoint: str,
    body: dict[str, Any],
    model: str,
    profile: Profile,
    cached_tokens: int | None = None,
    usage: bool = False,
) -> Reply:
    """Script the answer to `body` sent to `endpoint` ("chat/completions", "completions" or "embeddings").

    `cached_tokens`, when given, is reported as usage.prompt_tokens_details.cached_tokens, as vLLM and OpenAI
    report a prefix-cache hit. `usage`: a stream reports its usage as if `stream_options.include_usage` had
    been sent.
    """
    try:
        if endpoint == "chat/completions":
            return _chat(body, model, profile, cached_tokens, usage)
        if endpoint == "completions":
            return _completion(body, model, profile, cached_tokens, usage)
        if endpoint == "embeddings":
            return _embeddings(body, model, profile)
        if endpoint == "responses":
            from gateway.simulation.responses import respond  # imports this module: import when used

            return respond(body, model, profile)
    except _Invalid as exc:
        return error_reply(400, exc.message, exc.param)
    return error_reply(404, f"no such endpoint: {endpoint}")


def error_reply(status: int, message: str, param: str | None = None) -> Reply:
    """An immediate OpenAI-style error."""
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    return Reply(status, JSON, [orjson.dumps({"error": error})], 0.0, 0.0)


def json_reply(status: int, body: object) -> Reply:
    """An immediate JSON answer (model lists, health)."""
    return Reply(status, JSON, [orjson.dumps(body)], 0.0, 0.0)


# Endpoints


def chat_tokens(messages: list[Any]) -> list[str]:
    """The simulated tokenisation of valid chat messages (see the module docstring)."""
    tokens: list[str] = []
    for message in messages:
        tokens += ("<|start|>", message["role"], "<|sep|>")
        tokens += _content_text(message.get("content")).split()
        tokens.append("<|end|>")
    return tokens


def _chat(body: dict[str, Any], model: str, profile: Profile, cached: int | None, usage_always: bool) -> Reply:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _Invalid("'messages' must be a non-empty array", "messages")
    prompt_tokens = sum(_message_tokens(message, i) for i, message in enumerate(messages))
    count, finish = _length(body, profile, ("max_completion_tokens", "max_tokens"))
    stream, include_usage = _stream_flags(body)
    include_usage = include_usage or (stream and usage_always)
    ident, picks = _pick(b"chat\0" + _canonical(messages, "messages"), count)
    head = {"id": "chatcmpl-" + ident, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    usage = _usage(prompt_tokens, count, cached)
    text = _text(picks)
    if not stream:
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        if profile.failures:  # a scripted backend: answers shaped as asked, some spoiled (simulation/faults.py)
            fault = faults.pick(profile.failures, b"fault\0" + _canonical(messages, "messages"))
            faults.shape(body, choice, text.split(), fault)
        whole = _whole({**head, "object": "chat.completion", "choices": [choice], "usage": usage}, profile, count)
        whole.text = text
        return whole
    usage_null = b',"usage":null' if include_usage else b""
    events = [_event(head, {"index": 0, "delta": {"role": "assistant", "content": ""}}, None, include_usage)]
    left = orjson.dumps(head)[:-1] + b',"choices":[{"index":0,"delta":{"content":'
    right = b'},"logprobs":null,"finish_reason":null}]' + usage_null + b"}"
    events += _token_events(picks, left, right)
    events.append(_event(head, {"index": 0, "delta": {}}, finish, include_usage))
    streamed = _stream(events, head, usage if include_usage else None, profile, count)
    streamed.text = text
    return streamed


def _completion(body: dict[str, Any], model: str, profile: Profile, cached: int | None, usage_always: bool) -> Reply:
    texts = _inputs(body.get("prompt"), "prompt")
    prompt_tokens = sum(len(text.split()) for text in texts)
    count, finish = _length(body, profile, ("max_tokens",))
    stream, include_usage = _stream_flags(body)
    include_usage = include_usage or (stream and usage_always)
    ident, picks = _pick(b"completions\0" + orjson.dumps(texts), count)
    head = {"id": "cmpl-" + ident, "object": "text_completion", "created": int(time.time()), "model": model}
    usage = _usage(prompt_tokens, count, cached)
    text = _text(picks)
    if not stream:
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
        whole = _whole({**head, "choices": [choice], "usage": usage}, profile, count)
        whole.text = text
        return whole
    usage_null = b',"usage":null' if include_usage else b""
    left = orjson.dumps(head)[:-1] + b',"choices":[{"text":'
    right = b',"index":0,"logprobs":null,"finish_reason":null}]' + usage_null + b"}"
    events = _token_events(picks, left, right)
    events.append(_event(head, {"text": "", "index": 0}, finish, include_usage))
    streamed = _stream(events, head, usage if include_usage else None, profile, count)
    streamed.text = text
    return streamed


def _embeddings(body: dict[str, Any], model: str, profile: Profile) -> Reply:
    texts = _inputs(body.get("input"), "input")
    dim = body.get("dimensions")
    if dim is None:
        dim = profile.embedding_dim
    elif type(dim) is not int or not 1 <= dim <= _MAX_DIMENSIONS:
        raise _Invalid(f"'dimensions' must be an integer from 1 to {_MAX_DIMENSIONS}", "dimensions")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise _Invalid("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    data = [
        {"object": "embedding", "index": i, "embedding": _vector(text, dim, encoding == "base64")}
        for i, text in enumerate(texts)
    ]
    tokens = sum(len(text.split()) for text in texts)
    answer = {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return Reply(200, JSON, [orjson.dumps(answer)], profile.ttft_ms / 1000.0, 0.0)


# Building blocks


def _usage(prompt_tokens: int, count: int, cached: int | None) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": count,
        "total_tokens": prompt_tokens + count,
    }
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _whole(answer: dict[str, Any], profile: Profile, count: int) -> Reply:
    delay = (profile.ttft_ms + profile.tpot_ms * (count - 1)) / 1000.0
    return Reply(200, JSON, [orjson.dumps(answer)], delay, 0.0, count)


def _stream(
    events: list[bytes], head: dict[str, Any], usage: dict[str, Any] | None, profile: Profile, count: int
) -> Reply:
    if usage is not None:
        events.append(sse(orjson.dumps({**head, "choices": [], "usage": usage})))
    events.append(DONE)
    return Reply(200, SSE, events, profile.ttft_ms / 1000.0, profile.tpot_ms / 1000.0, count)


def _event(head: dict[str, Any], choice: dict[str, Any], finish: str | None, include_usage: bool) -> bytes:
    chunk = {**head, "choices": [{**choice, "logprobs": None, "finish_reason": finish}]}
    if include_usage:
        chunk["usage"] = None
    return sse(orjson.dumps(chunk))


def _token_events(picks: bytes, left: bytes, right: bytes) -> list[bytes]:
    """Token events from one template: `sse(left + token + right)`, framed once rather than per token."""
    before, _, after = sse(left + _SLOT + right).partition(_SLOT)
    events = [before + _FIRST_JSON[picks[0]] + after]
    events += [before + _NEXT_JSON[pick] + after for pick in picks[1:]]
    return events


def _pick(seed: bytes, count: int) -> tuple[str, bytes]:
    """A hex id and `count` word indexes, all derived from `seed`."""
    digest = hashlib.shake_128(seed).digest(_ID_BYTES + count)
    return digest[:_ID_BYTES].hex(), bytes(b & 63 for b in digest[_ID_BYTES:])


def _text(picks: bytes) -> str:
    return " ".join(WORDS[pick] for pick in picks)


def _vector(text: str, dim: int, as_base64: bool) -> list[float] | str:
    raw = struct.unpack(f"<{dim}H", hashlib.shake_128(text.encode()).digest(2 * dim))
    values = [value / 32767.5 - 1.0 for value in raw]
    norm = math.sqrt(sum(value * value for value in values)) or 1.0
    values = [value / norm for value in values]
    if as_base64:
        return base64.b64encode(struct.pack(f"<{dim}f", *values)).decode("ascii")
    return values


def _length(body: dict[str, Any], profile: Profile, names: tuple[str, ...]) -> tuple[int, str]:
    """How many tokens to answer with, and the finish reason."""
    natural = max(1, profile.tokens)
    for name in names:
        limit = body.get(name)
        if limit is None:
            continue
        if type(limit) is not int or limit < 1:
            raise _Invalid(f"'{name}' must be a positive integer", name)
        if limit < natural:
            return limit, "length"
        break
    return natural, "stop"


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = body.get("stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise _Invalid("'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise _Invalid("'stream_options' must be an object", "stream_options")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise _Invalid("'stream_options.include_usage' must be a boolean", "stream_options.include_usage")
    return stream, stream and bool(include_usage)


def _message_tokens(message: Any, index: int) -> int:
    """A rough prompt-token count: words plus 4 per message for the chat framing."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise _Invalid("each message must be an object with a string 'role'", f"messages[{index}]")
    content = message.get("content")
    if content is None:
        return 4
    if isinstance(content, str):
        return 4 + len(content.split())
    if isinstance(content, list):
        texts = (part.get("text") for part in content if isinstance(part, dict))
        return 4 + sum(len(text.split()) for text in texts if isinstance(text, str))
    raise _Invalid("message content must be a string or an array of parts", f"messages[{index}].content")


def _content_text(content: Any) -> str:
    """A validated message content's text: the string, or its text parts joined by spaces."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = (part.get("text") for part in content if isinstance(part, dict))
        return " ".join(text for text in texts if isinstance(text, str))
    return ""


def _inputs(value: Any, param: str) -> list[str]:
    """A prompt or embedding input as texts: a string, strings, token ids or arrays of token ids."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return value
        if all(type(item) is int for item in value):
            return [" ".join(map(str, value))]
        if all(isinstance(item, list) and item and all(type(i) is int for i in item) for item in value):
            return [" ".join(map(str, item)) for item in value]
    raise _Invalid(f"'{param}' must be a string, an array of strings or an array of token ids", param)


def _canonical(value: Any, param: str) -> bytes:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError as exc:
        raise _Invalid(f"'{param}' cannot be encoded as JSON: {exc}", param) from exc
