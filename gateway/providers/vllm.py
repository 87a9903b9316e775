"""vLLM's OpenAI-compatible server: the OpenAI wire format, the key optional (`--api-key`)."""

from __future__ import annotations

from typing import ClassVar

from gateway.providers.http import HttpProvider


class VLLMProvider(HttpProvider):
    kind: ClassVar[str] = "vllm"
    # vLLM has no well-known gen_ai.provider.name; it speaks the OpenAI API, so traces group with it.
    system: ClassVar[str] = "openai"
