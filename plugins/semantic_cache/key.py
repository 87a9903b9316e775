"""What a request is looked up by: the text that is embedded, and the partition that must match exactly.

A semantic match may only stand in for an answer when everything but the wording of the question is the same.
So a request splits in two:

- the **text**: with `embed: last_user` (the default) the last message's text, which must be the user's (a
  request ending on a tool result or an assistant prefill is not looked up); with `embed: conversation` every
  message as `role: content` lines, for deployments that want whole short dialogues to match. For the
  completions endpoint, the prompt.
- the **partition**: the sha256 of the canonical JSON of everything else that changes the answer: the endpoint,
  every request field but the transport-only ones (`stream`, `stream_options`, `user`, `metadata`, `store`,
  `prompt_cache_key`, `safety_identifier`),
  with the embedded text cut out of the messages (so the system prompt, earlier turns, tools, response format
  and sampling parameters all count), the embedding model and the embedding mode. Tenant and model are kept
  beside it in clear, so that a store can filter on them and `sluice cache purge --tenant` can find a tenant's
  entries; an embedding-model change moves every request to a new partition, so old vectors never match.

`plan()` returns a `Lookup`, or a short reason why the request is not eligible (which is what is counted and
shown in `x-sluice-semantic: bypass`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import orjson

if TYPE_CHECKING:
    from gateway.context import Exchange

EmbedMode = Literal["last_user", "conversation"]
TRANSPORT_ONLY = frozenset(
    {"stream", "stream_options", "user", "metadata", "store", "prompt_cache_key", "safety_identifier"}
)
ENDPOINTS = frozenset({"chat/completions", "completions", "responses"})
# A Responses request may be stored and read back by its id: `store` changes what the answer is (as in the exact
# cache), so it stays in the partition.
RESPONSES_TRANSPORT_ONLY = TRANSPORT_ONLY - {"store"}
CUT = "\x00embedded"
TEXT_PARTS = frozenset(
    {"text", "input_text", "output_text"}
)  # chat's, and the Responses API's  # what stands in the partition for the text that is embedded


@dataclass(frozen=True, slots=True)
class Rules:
    """One model's eligibility rules and what makes its partitions, fixed at start-up."""

    embedding_model: str
    embed: EmbedMode
    max_temperature: float
    allow_tools: bool
    max_text_chars: int


@dataclass(frozen=True, slots=True)
class Lookup:
    text: str  # what is embedded
    partition: str  # hex sha256 of the rest: must match exactly


def plan(ex: Exchange, rules: Rules) -> Lookup | str:
    """The lookup for an eligible request, else why it is not eligible."""
    if ex.endpoint not in ENDPOINTS or ex.resource:
        return "endpoint"
    body = ex.json
    n = body.get("n", 1)
    if n is not None and n != 1:
        return "n"
    temperature = body.get("temperature", 1.0)  # the API's default when none is sent
    if temperature is None:
        temperature = 1.0
    if not isinstance(temperature, int | float) or temperature > rules.max_temperature:
        return "temperature"
    if (body.get("tools") or body.get("functions")) and not rules.allow_tools:
        return "tools"
    if ex.endpoint == "responses" and body.get("background"):
        return "background"  # polled by its id, not answered: nothing to replay
    if ex.endpoint == "completions":
        text, rest = _prompt(body)
    elif ex.endpoint == "responses":
        text, rest = _input(body, rules.embed)
    elif rules.embed == "last_user":
        text, rest = _last_user(body)
    else:
        text, rest = _conversation(body)
    if text is None:
        return "input"
    if len(text) > rules.max_text_chars:
        return "length"  # an embedding model truncates: a long text's tail would not count
    skip = RESPONSES_TRANSPORT_ONLY if ex.endpoint == "responses" else TRANSPORT_ONLY
    fields = {k: v for k, v in rest.items() if k not in skip}
    material = orjson.dumps(
        [ex.endpoint, rules.embedding_model, rules.embed, fields], option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS
    )
    return Lookup(text, hashlib.sha256(material).hexdigest())


def text_of(content: Any) -> str | None:
    """A message's text: a string, or text parts only (an image or audio part is not embedded, so not eligible)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") not in TEXT_PARTS
                or not isinstance(part.get("text"), str)
            ):
                return None
            parts.append(part["text"])
        return "\n".join(parts)
    return None


def _last_user(body: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None, body
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "user":
        return None, body
    text = text_of(last.get("content"))
    if not text or not text.strip():
        return None, body
    cut = {**last, "content": CUT}
    return text, {**body, "messages": [*messages[:-1], cut]}


def _conversation(body: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None, body
    lines = []
    for message in messages:
        if not isinstance(message, dict) or set(message) - {"role", "content", "name"}:
            return None, body  # tool calls and their results are not text to compare by meaning
        text = text_of(message.get("content"))
        if text is None:
            return None, body
        lines.append(f"{message.get('role')}: {text}")
    if not isinstance(messages[-1], dict) or messages[-1].get("role") != "user":
        return None, body
    return "\n".join(lines), {k: v for k, v in body.items() if k != "messages"}


def _prompt(body: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt.strip():
        return None, body
    return prompt, {**body, "prompt": CUT}


def _input(body: dict[str, Any], embed: EmbedMode) -> tuple[str | None, dict[str, Any]]:
    """A Responses request's text: its `input` string, or the last item of its `input` list, which must be a
    user message (with `embed: conversation`, every item, each a message with text). `instructions`,
    `previous_response_id` and the earlier items stay in the partition, as a chat request's history does."""
    items = body.get("input")
    if isinstance(items, str):
        return (items, {**body, "input": [CUT]}) if items.strip() else (None, body)
    if not isinstance(items, list) or not items:
        return None, body
    messages: list[dict[str, Any] | None] = []
    for item in items:
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            messages.append(None)  # a tool call or its output, a reasoning item: not text to compare by meaning
            continue
        messages.append({"role": item.get("role"), "content": item.get("content")})
    if embed == "conversation":
        if any(m is None for m in messages):
            return None, body
        text, _ = _conversation({"messages": messages})
        return text, {k: v for k, v in body.items() if k != "input"}
    last = messages[-1]
    if last is None or last.get("role") != "user":
        return None, body
    text = text_of(last.get("content"))
    if not text or not text.strip():
        return None, body
    # The user's message is cut whole: a string input and a list of one user message are the same request.
    return text, {**body, "input": [*items[:-1], CUT]}
