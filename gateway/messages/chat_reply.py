"""A chat completions answer as a Messages answer: the whole JSON, and a stream event by event.

The stream translation keeps up with the upstream: each chat chunk becomes the Messages events it implies as
soon as it arrives (nothing is held back but an unfinished SSE event at the end of a read). message_start
(with usage: the prompt as estimated here, the stream's true counts coming in message_delta) and a ping go out
with the first chunk; text deltas open a text block, each tool call a tool_use block whose arguments go out as
input_json_delta; the finish reason becomes message_delta's stop_reason, the usage chunk its usage, and
`[DONE]` closes the open block, then message_delta and message_stop. An upstream error event becomes an
Anthropic `error` event. When the client asked for thinking, the model's reasoning (`reasoning_content` or
`reasoning`, as vLLM, llama.cpp, DeepSeek and Ollama send it) becomes thinking blocks, with an empty signature
(none can be made here; the translation drops thinking blocks sent back, so it is never checked).

Usage: OpenAI's `prompt_tokens` includes cached tokens, Anthropic's `input_tokens` does not: the cached ones
(`prompt_tokens_details.cached_tokens`) are reported as `cache_read_input_tokens`.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.messages.refusals import error_event
from gateway.wire.message_events import PING, sse

STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}


# A text delta, the event of almost every token: one template rather than a dict serialised each time.
TEXT_DELTA = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,'
    b'"delta":{"type":"text_delta","text":%b}}\n\n'
)


SIGNATURE = {"type": "signature_delta", "signature": ""}


def message_id(chat_id: Any) -> str:
    text = str(chat_id or "")
    return "msg_" + (text.partition("-")[2] or text or "0")


def usage_of(usage: Any) -> dict[str, int]:
    """OpenAI's usage in Anthropic's names."""
    if not isinstance(usage, dict):
        return {"input_tokens": 0, "output_tokens": 0}
    prompt = usage.get("prompt_tokens") or 0
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    cached = cached if type(cached) is int else 0
    return {
        "input_tokens": max(prompt - cached, 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": usage.get("completion_tokens") or 0,
    }


def stop_reason(finish: Any) -> str:
    return STOP_REASONS.get(str(finish), "end_turn")


def arguments(raw: Any) -> Any:
    """A tool call's arguments as the tool_use block's input (an object); unparsable text is kept as a string
    under `_raw` rather than lost."""
    if not raw:
        return {}
    try:
        parsed = orjson.loads(raw)
    except (orjson.JSONDecodeError, TypeError):
        return {"_raw": raw}
    return parsed if isinstance(parsed, dict) else {"_raw": raw}


def reasoning_of(part: dict[str, Any]) -> Any:
    """A chat message's or delta's reasoning text: `reasoning_content` (vLLM, llama.cpp, DeepSeek) or `reasoning`."""
    found = part.get("reasoning_content")
    return found if found is not None else part.get("reasoning")


def whole(body: bytes, model: str, thinking: bool = False) -> bytes:
    """A whole chat completion as a Messages answer (usage last, where the accounting looks for it); with
    `thinking` (the client asked for it), the model's reasoning as a thinking block first."""
    answer = orjson.loads(body)
    choice = (answer.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    reasoning = reasoning_of(message) if thinking else None
    if isinstance(reasoning, str) and reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = message.get("content")
    if text:
        content.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        block = {"type": "tool_use", "id": call.get("id") or "", "name": function.get("name") or ""}
        block["input"] = arguments(function.get("arguments"))
        content.append(block)
    result = {
        "id": message_id(answer.get("id")),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(choice.get("finish_reason")),
        "stop_sequence": None,
        "usage": usage_of(answer.get("usage")),
    }
    return orjson.dumps(result)


class StreamTranslator:
    """One chat stream's translation, fed the upstream's reads in order."""

    def __init__(self, model: str, prompt_estimate: int, thinking: bool = False) -> None:
        self.model = model
        self.prompt_estimate = prompt_estimate
        self.thinking = thinking  # the client asked for thinking: the model's reasoning becomes thinking blocks
        self.held = b""
        self.started = False
        self.block = -1  # the index of the open block, -1 when none is open
        self.kind = ""  # "text", "tool" or "thinking" for the open block
        self.blocks = 0  # blocks opened so far
        self.tools: dict[int, int] = {}  # a chat tool call's index -> its block's index
        self.finish: Any = None
        self.usage: Any = None
        self.ended = False

    def feed(self, data: bytes) -> bytes:
        """The Messages events for the complete SSE events in `data` (with what an earlier read left)."""
        data = self.held + data if self.held else data
        end = data.rfind(b"\n\n")
        if end < 0:
            self.held = data
            return b""
        self.held = data[end + 2 :]
        out: list[bytes] = []
        for line in data[:end].split(b"\n"):
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                out.append(self._end())
                continue
            try:
                chunk = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if isinstance(chunk, dict):
                out.append(self._chunk(chunk))
        return b"".join(out)

    def _start(self, chunk: dict[str, Any]) -> bytes:
        self.started = True
        message: dict[str, Any] = {
            "id": message_id(chunk.get("id")),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": self.prompt_estimate,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "output_tokens": 0,
            },
        }
        return sse({"type": "message_start", "message": message}) + PING

    def _chunk(self, chunk: dict[str, Any]) -> bytes:
        if self.ended:
            return b""
        if "error" in chunk:
            error = chunk.get("error")
            message = error.get("message") if isinstance(error, dict) else None
            self.ended = True
            return error_event(500, message if isinstance(message, str) else "the upstream failed")
        out = b"" if self.started else self._start(chunk)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = reasoning_of(delta) if self.thinking else None
            if isinstance(reasoning, str) and reasoning:
                if self.kind != "thinking":
                    out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                thought = {"type": "thinking_delta", "thinking": reasoning}
                out += sse({"type": "content_block_delta", "index": self.block, "delta": thought})
            text = delta.get("content")
            if text:
                if self.kind != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                out += TEXT_DELTA % (self.block, orjson.dumps(text))
            for call in delta.get("tool_calls") or ():
                out += self._tool(call)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def _tool(self, call: dict[str, Any]) -> bytes:
        out = b""
        position = call.get("index", 0)
        function = call.get("function") or {}
        block = self.tools.get(position)
        if block is None:
            ident = call.get("id") or f"toolu_{position}"
            start = {"type": "tool_use", "id": ident, "name": function.get("name") or ""}
            out += self._open("tool", {**start, "input": {}})
            block = self.tools[position] = self.block
        piece = function.get("arguments")
        if piece:
            delta = {"type": "input_json_delta", "partial_json": piece}
            out += sse({"type": "content_block_delta", "index": block, "delta": delta})
        return out

    def _open(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        self.block = self.blocks
        self.blocks += 1
        self.kind = kind
        return out + sse({"type": "content_block_start", "index": self.block, "content_block": block})

    def _close(self) -> bytes:
        if self.block < 0:
            return b""
        out = b""
        if self.kind == "thinking":  # as Anthropic's API ends a thinking block (no signature can be made here)
            out += sse({"type": "content_block_delta", "index": self.block, "delta": SIGNATURE})
        out += sse({"type": "content_block_stop", "index": self.block})
        self.block = -1
        self.kind = ""
        return out

    def _end(self) -> bytes:
        if self.ended:
            return b""
        self.ended = True
        out = b"" if self.started else self._start({})
        out += self._close()
        usage = usage_of(self.usage)
        if self.usage is None:
            usage["input_tokens"] = self.prompt_estimate
        delta = {"stop_reason": stop_reason(self.finish), "stop_sequence": None}
        out += sse({"type": "message_delta", "delta": delta, "usage": usage})
        return out + sse({"type": "message_stop"})
