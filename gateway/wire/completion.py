"""Completions in both wire forms: assemble a streamed answer into one object, replay one as a stream.

Used off the hot path only (after a response has ended, or to answer from a stored entry). A stream
assembles only when it really ended: `[DONE]` seen and every choice has its finish reason; anything
else returns None, so a truncated answer can never pass for a whole one.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.wire import message_events, response_events


def sse(data: bytes) -> bytes:
    """One SSE event carrying `data` (a JSON document or `[DONE]`): the one writer of events there is."""
    return b"data: " + data + b"\n\n"


DONE_EVENT = sse(b"[DONE]")
# Replayed content goes out in pieces of about this many characters: the client's stream parser and any
# UI see a stream, and the whole replay still fits in one write.
PIECE = 64
HEAD_KEYS = ("id", "created", "model", "system_fingerprint", "service_tier")


def events(body: bytes) -> tuple[list[dict[str, Any]], bool]:
    """The JSON events of an SSE body, and whether it ended with [DONE]."""
    datas = [line[5:].strip() for line in body.splitlines() if line.startswith(b"data:")]
    done = False
    while b"[DONE]" in datas:
        datas.remove(b"[DONE]")
        done = True
    try:
        # One parse for the whole stream rather than one per event.
        parsed = orjson.loads(b"[" + b",".join(datas) + b"]")
    except orjson.JSONDecodeError:
        parsed = []
        for data in datas:
            try:
                parsed.append(orjson.loads(data))
            except orjson.JSONDecodeError:
                continue
    return [event for event in parsed if isinstance(event, dict)], done


def assemble(endpoint: str, body: bytes) -> dict[str, Any] | None:
    """The whole answer a complete SSE body adds up to, in the non-stream shape; None if incomplete."""
    if endpoint == "responses":
        return response_events.assemble(body)
    if endpoint == "messages":
        return message_events.assemble(body)
    chunks, done = events(body)
    if not done or not chunks or any("error" in chunk for chunk in chunks):
        return None
    chat = endpoint == "chat/completions"
    head: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    # Every chunk repeats the head; an Azure preamble has it empty, and some fields come late.
    for chunk in chunks[:3] + chunks[-2:]:
        for key in HEAD_KEYS:
            if key not in head and chunk.get(key):
                head[key] = chunk[key]
    for chunk in chunks:
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            index = choice.get("index", 0)
            into = choices.setdefault(index, {"index": index, "parts": [], "tools": {}, "finish_reason": None})
            if choice.get("finish_reason"):
                into["finish_reason"] = choice["finish_reason"]
            if chat:
                _merge_delta(into, choice.get("delta") or {})
            elif choice.get("text"):
                into["parts"].append(choice["text"])
    if not choices or any(c["finish_reason"] is None for c in choices.values()):
        return None
    result: dict[str, Any] = {
        "id": head.get("id", ""),
        "object": "chat.completion" if chat else "text_completion",
        "created": head.get("created", 0),
        "model": head.get("model", ""),
        "choices": [_finish(choices[i], chat) for i in sorted(choices)],
        "usage": usage,
    }
    for key in ("system_fingerprint", "service_tier"):
        if key in head:
            result[key] = head[key]
    return result


def finished(endpoint: str, body: bytes, usage: dict[str, Any] | None) -> bytes | None:
    """A streamed body as a cache keeps it: the whole answer in the non-stream shape, or None when it is not
    a finished one (a Responses stream not `completed`, a choice without its finish reason, an error event).
    `usage` goes in when the stream carried none (the client did not ask; the upstream was asked anyway)."""
    try:
        answer = assemble(endpoint, body)
    except orjson.JSONDecodeError:
        return None
    if answer is None:
        return None
    if endpoint == "responses":
        if answer.get("status") != "completed":
            return None
    elif endpoint == "messages":
        if not answer.get("stop_reason"):
            return None
    elif not all(c.get("finish_reason") for c in answer.get("choices") or [{}]):
        return None
    if answer.get("usage") is None and usage is not None:
        answer["usage"] = usage
    return orjson.dumps(answer)


def _merge_delta(into: dict[str, Any], delta: dict[str, Any]) -> None:
    if delta.get("content"):
        into["parts"].append(delta["content"])
    if delta.get("refusal"):
        into["refusal"] = into.get("refusal", "") + delta["refusal"]
    for call in delta.get("tool_calls") or ():
        slot = into["tools"].setdefault(
            call.get("index", 0), {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if call.get("id"):
            slot["id"] = call["id"]
        function = call.get("function") or {}
        if function.get("name"):
            slot["function"]["name"] += function["name"]
        if function.get("arguments"):
            slot["function"]["arguments"] += function["arguments"]


def _finish(choice: dict[str, Any], chat: bool) -> dict[str, Any]:
    text = "".join(choice["parts"])
    if not chat:
        return {"text": text, "index": choice["index"], "logprobs": None, "finish_reason": choice["finish_reason"]}
    message: dict[str, Any] = {"role": "assistant", "content": text or None, "refusal": choice.get("refusal")}
    if choice["tools"]:
        message["tool_calls"] = [choice["tools"][i] for i in sorted(choice["tools"])]
    elif message["content"] is None:
        message["content"] = ""
    return {"index": choice["index"], "message": message, "logprobs": None, "finish_reason": choice["finish_reason"]}


def replay(endpoint: str, answer: dict[str, Any], include_usage: bool) -> bytes:
    """A stored answer as the SSE body a live stream of it would have been."""
    if endpoint == "responses":
        return response_events.replay(answer)
    if endpoint == "messages":
        return message_events.replay(answer)  # a Messages stream always carries its usage
    chat = endpoint == "chat/completions"
    head = {
        "id": answer.get("id", ""),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": answer.get("created", 0),
        "model": answer.get("model", ""),
    }
    if "system_fingerprint" in answer:
        head["system_fingerprint"] = answer["system_fingerprint"]
    out: list[bytes] = []

    def emit(choices: list[dict[str, Any]], usage: Any = None) -> None:
        chunk = {**head, "choices": choices}
        if include_usage:
            chunk["usage"] = usage
        out.append(sse(orjson.dumps(chunk)))

    for choice in answer.get("choices") or ():
        index = choice.get("index", 0)
        if chat:
            message = choice.get("message") or {}
            emit(
                [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for piece in _pieces(message.get("content") or ""):
                emit([{"index": index, "delta": {"content": piece}, "logprobs": None, "finish_reason": None}])
            for position, call in enumerate(message.get("tool_calls") or ()):
                emit(
                    [
                        {
                            "index": index,
                            "delta": {"tool_calls": [{"index": position, **call}]},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            emit([{"index": index, "delta": {}, "logprobs": None, "finish_reason": choice.get("finish_reason")}])
        else:
            for piece in _pieces(choice.get("text") or ""):
                emit([{"text": piece, "index": index, "logprobs": None, "finish_reason": None}])
            emit([{"text": "", "index": index, "logprobs": None, "finish_reason": choice.get("finish_reason")}])
    if include_usage and answer.get("usage"):
        emit([], answer["usage"])
    out.append(DONE_EVENT)
    return b"".join(out)


def _pieces(text: str) -> list[str]:
    return [text[i : i + PIECE] for i in range(0, len(text), PIECE)]
