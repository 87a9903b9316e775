"""vLLM's OpenAI-compatible server: the OpenAI wire format, the key optional (`--api-key`).

Its `GET /health` (at the server's root, not under /v1) answers 200 while the engine is alive; the server
listens only once the model is loaded, so until then the backend is `down`, not `loading`. It supports `n`
and honours `stream_options.include_usage`.
"""

from __future__ import annotations

from typing import ClassVar

from gateway.upstream.providers.selfhosted import SelfHostedProvider


class VLLMProvider(SelfHostedProvider):
    kind: ClassVar[str] = "vllm"
    # vLLM has no well-known gen_ai.provider.name; it speaks the OpenAI API, so traces group with it.
    system: ClassVar[str] = "openai"
    health_path: ClassVar[str] = "/health"
