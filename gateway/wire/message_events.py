"""Anthropic's Messages stream, made from a message object and assembled back into one: for replays.

A stream is `event: TYPE` + `data: JSON` pairs: message_start (the message with empty content and its usage so
far), ping, then per content block content_block_start, content_block_delta... (text_delta, input_json_delta,
thinking_delta) and content_block_stop, then message_delta (stop_reason, stop_sequence and the usage) and
message_stop. Used off the hot path only: after a response has ended, or to answer from a stored entry.
"""

from __future__ import annotations

from typing import Any

import orjson

# Replayed text goes out in pieces of about this many characters, as completion.py does for chat.
PIECE = 64
PING = b'event: ping\ndata: {"type":"ping"}\n\n'


def sse(event: dict[str, Any]) -> bytes:
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def replay(message: dict[str, Any]) -> bytes:
    """A whole message as the stream a live answer would have been."""
    usage = message.get("usage") or {}
    opening = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
    opening["usage"] = {**usage, "output_tokens": min(1, usage.get("output_tokens") or 0)}
    out = [sse({"type": "message_start", "message": opening}), PING]
    for index, block in enumerate(message.get("content") or ()):
        kind = block.get("type")
        if kind == "text":
            text = block.get("text") or ""
            out.append(sse({"type": "content_block_start", "index": index, "content_block": {**block, "text": ""}}))
            for i in range(0, len(text), PIECE):
                delta = {"type": "text_delta", "text": text[i : i + PIECE]}
                out.append(sse({"type": "content_block_delta", "index": index, "delta": delta}))
        elif kind in ("tool_use", "server_tool_use"):
            start = {**block, "input": {}}
            out.append(sse({"type": "content_block_start", "index": index, "content_block": start}))
            delta = {"type": "input_json_delta", "partial_json": orjson.dumps(block.get("input", {})).decode()}
            out.append(sse({"type": "content_block_delta", "index": index, "delta": delta}))
        elif kind == "thinking":
            start = {**block, "thinking": "", "signature": ""}
            out.append(sse({"type": "content_block_start", "index": index, "content_block": start}))
            delta = {"type": "thinking_delta", "thinking": block.get("thinking", "")}
            out.append(sse({"type": "content_block_delta", "index": index, "delta": delta}))
            signature = {"type": "signature_delta", "signature": block.get("signature", "")}
            out.append(sse({"type": "content_block_delta", "index": index, "delta": signature}))
        else:
            out.append(sse({"type": "content_block_start", "index": index, "content_block": block}))
        out.append(sse({"type": "content_block_stop", "index": index}))
    delta = {"stop_reason": message.get("stop_reason"), "stop_sequence": message.get("stop_sequence")}
    out.append(sse({"type": "message_delta", "delta": delta, "usage": usage}))
    out.append(sse({"type": "message_stop"}))
    return b"".join(out)


def assemble(body: bytes) -> dict[str, Any] | None:
    """The message a complete stream adds up to; None if it is incomplete (no message_stop) or failed."""
    message: dict[str, Any] | None = None
    blocks: dict[int, dict[str, Any]] = {}
    partial: dict[int, list[str]] = {}
    stopped = False
    for line in body.splitlines():
        if not line.startswith(b"data:"):
            continue
        try:
            event = orjson.loads(line[5:])
        except orjson.JSONDecodeError:
            return None
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "message_start":
            message = dict(event.get("message") or {})
        elif kind == "content_block_start":
            blocks[event.get("index", 0)] = dict(event.get("content_block") or {})
        elif kind == "content_block_delta":
            index = event.get("index", 0)
            block = blocks.get(index)
            delta = event.get("delta") or {}
            if block is None:
                return None
            what = delta.get("type")
            if what == "text_delta":
                block["text"] = block.get("text", "") + delta.get("text", "")
            elif what == "input_json_delta":
                partial.setdefault(index, []).append(delta.get("partial_json", ""))
            elif what == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + delta.get("thinking", "")
            elif what == "signature_delta":
                block["signature"] = delta.get("signature", "")
        elif kind == "message_delta" and message is not None:
            message.update(event.get("delta") or {})
            usage = event.get("usage")
            if isinstance(usage, dict):
                message["usage"] = {**(message.get("usage") or {}), **usage}
        elif kind == "message_stop":
            stopped = True
        elif kind == "error":
            return None
    if message is None or not stopped:
        return None
    for index, pieces in partial.items():
        joined = "".join(pieces)
        try:
            blocks[index]["input"] = orjson.loads(joined) if joined else {}
        except orjson.JSONDecodeError:
            return None
    message["content"] = [blocks[i] for i in sorted(blocks)]
    return message
