"""OpenAI: `{base_url}/chat/completions` with `Authorization: Bearer`."""

from __future__ import annotations

from typing import ClassVar

from gateway.upstream.providers.http import HttpProvider


class OpenAIProvider(HttpProvider):
    kind: ClassVar[str] = "openai"
    system: ClassVar[str] = "openai"
