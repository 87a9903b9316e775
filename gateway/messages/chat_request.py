"""A Messages request as a chat completions request, for backends that speak only OpenAI's API.

Field by field (docs/architecture.md has the table): `system` (a string, or text blocks joined by a blank line)
becomes the first message; each message's blocks keep their order: text and images become content parts,
`tool_use` blocks an assistant's `tool_calls`, `tool_result` blocks `tool` messages (placed first, right after
the assistant turn that called them, as chat completions requires); tools become functions, `tool_choice` its
chat form, `stop_sequences` `stop`, `metadata.user_id` `user`. What has no chat equivalent is refused with a
400 naming the field (`Refusal`), never dropped silently, with three documented exceptions that change
nothing the client can rely on: `cache_control` marks (OpenAI-shaped backends cache prompt prefixes
themselves, and the translation keeps the prompt's order, so their prefix cache still works), `thinking`
(a budget the model may use, not a promise of thinking blocks) and earlier turns' thinking blocks (which
Anthropic's API also ignores outside a tool-use loop).
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.messages.refusals import Refusal

# Backend kinds whose chat API takes `top_k` (OpenAI's and Azure's do not; TGI's chat route ignores it).
TOP_K_KINDS = frozenset({"vllm", "llamacpp", "ollama", "simulated"})
# Top-level fields with no chat equivalent: refused rather than dropped.
REFUSED = {
    "mcp_servers": "MCP servers are run by Anthropic's API",
    "container": "containers are Anthropic's code-execution sandboxes",
}
# Blocks whose meaning the chat API cannot carry.
SERVER_BLOCKS = ("server_tool_use", "web_search_tool_result", "code_execution_tool_result", "mcp_tool_use")


def to_chat(body: dict[str, Any], model: str) -> dict[str, Any]:
    """The chat completions body for `body` (a checked Messages request), sent as `model`."""
    for field, why in REFUSED.items():
        if body.get(field):
            raise Refusal(f"{field}: cannot be translated to chat completions ({why})", field)
    chat: dict[str, Any] = {"model": model, "messages": _system(body.get("system"))}
    for index, message in enumerate(body["messages"]):
        chat["messages"] += _message(message, index)
    chat["max_tokens"] = body["max_tokens"]
    for field in ("temperature", "top_p"):
        if body.get(field) is not None:
            chat[field] = body[field]
    stops = body.get("stop_sequences")
    if stops:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise Refusal("stop_sequences: must be an array of strings", "stop_sequences")
        chat["stop"] = stops
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        chat["user"] = metadata["user_id"]
    tools = body.get("tools")
    if tools:
        chat["tools"] = [_tool(tool, i) for i, tool in enumerate(tools)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        _tool_choice(choice, chat)
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def with_top_k(chat: dict[str, Any], body: dict[str, Any], kind: str, backend: str) -> dict[str, Any]:
    """`chat` with the request's `top_k`, for a backend kind that takes it; a 400 for one that does not."""
    top_k = body.get("top_k")
    if top_k is None:
        return chat
    if kind not in TOP_K_KINDS:
        raise Refusal(f"top_k: backend {backend!r} (type {kind}) has no top_k; leave it out", "top_k")
    return {**chat, "top_k": top_k}


def _system(system: Any, where: str = "system") -> list[dict[str, Any]]:
    if system is None or system == "" or system == []:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    texts = []
    for index, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise Refusal(f"{where}.{index}: only text blocks can be translated to chat completions", where)
        texts.append(block["text"])
    return [{"role": "system", "content": "\n\n".join(texts)}]


def _message(message: dict[str, Any], index: int) -> list[dict[str, Any]]:
    role = message["role"]
    content = message["content"]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if role == "system":  # a system turn within the conversation, where it stands
        return _system(content, f"messages.{index}.content")
    if role == "assistant":
        return [_assistant(content, index)]
    results: list[dict[str, Any]] = []  # tool messages come first: they answer the turn before
    parts: list[dict[str, Any]] = []
    for position, block in enumerate(content):
        where = f"messages.{index}.content.{position}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            results.append(_tool_result(block, where))
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            parts.append(_part(block, kind, where))
    if parts:
        results.append({"role": "user", "content": parts})
    return results


def _assistant(content: list[Any], index: int) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for position, block in enumerate(content):
        where = f"messages.{index}.content.{position}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use":
            arguments = orjson.dumps(block.get("input", {})).decode()
            function = {"name": block.get("name", ""), "arguments": arguments}
            calls.append({"id": block.get("id", ""), "type": "function", "function": function})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # an earlier turn's reasoning: not part of what a chat model is given
        else:
            raise Refusal(f"{where}: a {kind!r} block in an assistant turn cannot be translated to chat completions")
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        turn["tool_calls"] = calls
    elif turn["content"] is None:
        turn["content"] = ""
    return turn


def _part(block: Any, kind: Any, where: str) -> dict[str, Any]:
    if kind == "text":
        return {"type": "text", "text": str(block.get("text", ""))}
    if kind == "image":
        return {"type": "image_url", "image_url": {"url": _image_url(block.get("source"), where)}}
    if kind == "document":
        source = block.get("source")
        if isinstance(source, dict) and source.get("type") == "text" and isinstance(source.get("data"), str):
            return {"type": "text", "text": source["data"]}
        raise Refusal(f"{where}: only plain-text documents can be translated to chat completions (PDFs cannot)")
    if kind in SERVER_BLOCKS:
        raise Refusal(f"{where}: {kind} blocks belong to Anthropic's server tools and cannot be translated")
    raise Refusal(f"{where}: a {kind!r} block cannot be translated to chat completions")


def _image_url(source: Any, where: str) -> str:
    if isinstance(source, dict):
        if source.get("type") == "base64" and isinstance(source.get("data"), str):
            return f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
        if source.get("type") == "url" and isinstance(source.get("url"), str):
            return str(source["url"])
    raise Refusal(f"{where}.source: an image needs a base64 or url source to be translated (file ids cannot be)")


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for position, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else None
                raise Refusal(f"{where}.content.{position}: a tool result's {kind!r} block has no chat equivalent")
            texts.append(str(part.get("text", "")))
        text = "\n".join(texts)
    else:
        raise Refusal(f"{where}.content: must be a string or an array of text blocks")
    if block.get("is_error"):
        text = "Error: " + text  # chat completions has no error flag on a tool message
    return {"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": text}


def _tool(tool: Any, index: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") not in (None, "custom") or "input_schema" not in tool:
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise Refusal(f"tools.{index}: the server tool {kind!r} cannot be translated to chat completions", "tools")
    function: dict[str, Any] = {"name": tool.get("name", ""), "parameters": tool["input_schema"]}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any], chat: dict[str, Any]) -> None:
    kind = choice.get("type")
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name", "")}}
    else:
        raise Refusal(f"tool_choice: type {kind!r} cannot be translated to chat completions", "tool_choice")
    if choice.get("disable_parallel_tool_use") and "tools" in chat:
        chat["parallel_tool_calls"] = False
