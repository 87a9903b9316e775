"""The Responses API's stream, made from a response object: for the simulated backend and for replays.

A stream is `event: TYPE` + `data: JSON` pairs, each event with a `sequence_number` counting from 0:
response.created, response.in_progress, then per output item output_item.added, (for a message, per text
part) content_part.added, output_text.delta..., output_text.done, content_part.done, then output_item.done,
and the terminal event (response.completed, response.incomplete or response.failed) holding the whole
response with its usage. Used off the hot path only: after a response has ended, or to script one.
"""

from __future__ import annotations

from typing import Any

import orjson

TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}
# Replayed text goes out in pieces of about this many characters, as completion.py does for chat.
PIECE = 64


def sse(event: dict[str, Any]) -> bytes:
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def text_pieces(text: str) -> list[str]:
    """`text` cut at word boundaries into pieces of about PIECE characters."""
    pieces: list[str] = []
    start = 0
    while start < len(text):
        end = min(len(text), start + PIECE)
        space = text.rfind(" ", start + 1, end) if end < len(text) else -1
        if space > start:
            end = space
        pieces.append(text[start:end])
        start = end
    return pieces or [""]


def stream_events(response: dict[str, Any], pieces: list[list[str]] | None = None) -> list[list[dict[str, Any]]]:
    """The events of `response`'s stream, grouped: the preamble up to the first delta, each later delta, the rest.

    `pieces[i]` are the text deltas of output item i's first text part (default: its text in pieces); the
    grouping lets a player send the first group when the first token is due and one group per token after.
    """
    seq = 0

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        nonlocal seq
        made = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return made

    opening = {**response, "status": "in_progress", "output": [], "usage": None}
    if "completed_at" in opening:
        opening["completed_at"] = None
    groups: list[list[dict[str, Any]]] = [
        [event("response.created", response=opening), event("response.in_progress", response=opening)]
    ]
    current = groups[0]
    for index, item in enumerate(response.get("output") or []):
        if item.get("type") != "message":
            current.append(event("response.output_item.added", output_index=index, item=item))
            current.append(event("response.output_item.done", output_index=index, item=item))
            continue
        item_id = item.get("id", "")
        opened = {**item, "status": "in_progress", "content": []}
        current.append(event("response.output_item.added", output_index=index, item=opened))
        for part_index, part in enumerate(item.get("content") or []):
            at = {"item_id": item_id, "output_index": index, "content_index": part_index}
            if part.get("type") != "output_text":
                current.append(event("response.content_part.added", **at, part=part))
                current.append(event("response.content_part.done", **at, part=part))
                continue
            text = part.get("text", "")
            current.append(event("response.content_part.added", **at, part={**part, "text": ""}))
            deltas = pieces[index] if pieces is not None and index < len(pieces) else text_pieces(text)
            for i, delta in enumerate(deltas):
                if i:
                    current = []
                    groups.append(current)
                current.append(event("response.output_text.delta", **at, delta=delta, logprobs=[]))
            current = []
            groups.append(current)
            current.append(event("response.output_text.done", **at, text=text, logprobs=[]))
            current.append(event("response.content_part.done", **at, part=part))
        current.append(event("response.output_item.done", output_index=index, item=item))
    terminal = TERMINAL.get(response.get("status", "completed"), "response.completed")
    current.append(event(terminal, response=response))
    return groups


def replay(response: dict[str, Any]) -> bytes:
    """A whole response as its stream, in one piece."""
    return b"".join(sse(event) for group in stream_events(response) for event in group)


def assemble(body: bytes) -> dict[str, Any] | None:
    """The response of a Responses stream's terminal event; None if the stream has none."""
    found: dict[str, Any] | None = None
    for line in body.splitlines():
        if not line.startswith(b"data:"):
            continue
        try:
            event = orjson.loads(line[5:])
        except orjson.JSONDecodeError:
            continue
        if isinstance(event, dict) and event.get("type") in TERMINAL.values():
            response = event.get("response")
            found = response if isinstance(response, dict) else None
    return found
