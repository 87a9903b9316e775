"""The key of a request's leading prompt for prefix routing (upstream/route.py): chained block hashes and turn marks.

docs/architecture.md says why blocks grow deeper into the prompt, why turns are marked whole, and why the
hash is Python's own.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import chain
from operator import itemgetter
from typing import Any

# A prompt's key: the chained hashes of its blocks (ending at `block_ends`), the turn marks to look up (offset,
# hash), and the hash of the whole prompt, which the endpoint that serves it remembers (0: an empty prompt).
Blocks = tuple[list[int], list[tuple[int, int]], int]


ROLE_AND_CONTENT = itemgetter("role", "content")


def block_ends(block: int, max_blocks: int) -> list[int]:
    """Where the hashed blocks of a prompt end: every `block` characters up to four, then each block half as
    long again as the one before (rounded to `block`), up to `max_blocks * block` in all.

    The deeper into a prompt, the less a block's worth of difference matters to which endpoint holds more
    of it, and the fewer blocks the cheaper a pick: 16 KiB is 10 blocks rather than 32. A conversation's
    turns are found whole anyway, by their marks (`prompt_blocks`).
    """
    ends: list[int] = []
    limit = block * max_blocks
    end = 0
    while end < limit:
        step = block if len(ends) < 4 else max(block, end // 2 // block * block)
        end = min(end + step, limit)
        ends.append(end)
    return ends


def prompt_blocks(body: dict[str, Any], ends: list[int]) -> Blocks:
    """The key of a request's leading prompt: its blocks' chained hashes, its turn marks, its whole hash.

    The messages are taken in order (role and text), so a conversation's next turn begins with the same
    blocks as the turn before. A block's hash is Python's hash of (the previous block's hash, its text): the
    whole prompt up to its end, so equal hashes mean equal prefixes (but for a 64-bit collision, which costs
    one less well placed request, never a wrong answer). Python's string hash (SipHash, salted per process)
    runs in C over the text as it is, with no encoding; what the endpoints were sent is remembered only by
    this process, so the salt does no harm.

    Blocks end at fixed places, turns do not: the whole prompt's hash is remembered too, and a request looks
    up, besides its blocks, the prompt its last assistant message answered (the previous turn, whole) and its
    own whole prompt. A mark's hash is that of (the last block's hash before it, the text from there), so it
    does not depend on where other turns ended.

    Blocks stop at `ends[-1]` characters, the marks do not: a prompt longer than that (a shared document, tool
    definitions) has the same blocks as every other conversation that shares its head, and only its marks tell
    the conversations apart, so they cover the text past the last block too, whatever its length. That costs
    a long prompt one more pass of SipHash over its tail (about a microsecond per 10 KiB), a short one
    nothing.
    """
    answered = 0  # where the prompt that the last assistant message answered ends
    messages = body.get("messages")
    system = body.get("system")  # Anthropic's Messages API keeps the system prompt beside the messages
    if system is not None and isinstance(messages, list):
        messages = [{"role": "system", "content": system}, *messages]
    if isinstance(messages, list):
        text, answered = _chat_text(messages)
    else:
        prompt = body.get("prompt")
        text = prompt if isinstance(prompt, str) else ""
    length = len(text)
    model = body.get("model")
    seed = running = hash(model) if isinstance(model, str) else 0
    hashes = []
    start = 0
    for end in ends[: bisect_right(ends, length)]:
        running = hash((running, text[start:end]))
        hashes.append(running)
        start = end
    whole = hash((running, text[start:])) if length else 0
    marks = []
    if answered > 0:
        index = bisect_right(ends, answered) - 1 if answered >= ends[0] else -1
        base, at = (hashes[index], ends[index]) if index >= 0 else (seed, 0)
        marks.append((answered, hash((base, text[at:answered]))))
    if whole:
        marks.append((length, whole))
    return hashes, marks, whole


def _chat_text(messages: list[Any]) -> tuple[str, int]:
    """The messages' roles and texts joined by a separator, and where the last assistant message's prompt ends.

    Messages of string roles and contents take one comprehension and one join in C (a huge prompt is copied
    once, nothing next to its prefill); anything else (content arrays, a missing role) takes the walk.
    """
    try:
        parts = list(chain.from_iterable(map(ROLE_AND_CONTENT, messages)))
        text = "\x1e".join(parts)  # TypeError unless every part is a string
    except (KeyError, TypeError):
        pass
    else:
        answered = 0
        tail = 0  # the parts after the message looked at, and their separators
        for index in range(len(parts) - 2, 1, -2):  # the last assistant message: near the end
            tail += len(parts[index]) + len(parts[index + 1]) + 2
            if parts[index] == "assistant":
                answered = len(text) - tail
                break
        return text, answered
    parts = []
    append = parts.append
    size = 0  # of the text so far, with a separator after each part
    answered = 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        content = message.get("content")
        if not isinstance(content, str):
            content = _text(content)
        if not isinstance(role, str):
            role = ""
        elif role == "assistant":
            answered = size - 1
        append(role)
        append(content)
        size += len(role) + len(content) + 2
    return "\x1e".join(parts), answered


def _text(content: Any) -> str:
    """The text parts of a message's content array, joined; anything else has none."""
    if isinstance(content, list):
        return "".join(part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""
