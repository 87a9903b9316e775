"""llama.cpp's `llama-server`: `/v1/chat/completions`, `/v1/completions` and `/v1/embeddings` in the OpenAI format.

What is its own (ggml-org/llama.cpp, tools/server/README.md, "GET /health"; the `n` check in the server's
OpenAI-compatible parameter parsing, tools/server/utils.hpp):
- The HTTP server starts before the model is loaded. Until it is, `GET /health` (also `/v1/health`, never
  behind the API key) answers 503 `{"error": {"code": 503, "message": "Loading model", "type":
  "unavailable_error"}}`, and so do the completion routes; then 200 `{"status": "ok"}`. The backend is
  `loading` meanwhile: requests go to their fallbacks first, and a 503 that still gets through is retried on
  the next target like any 503.
- One choice per request: the server throws "Only one completion choice is allowed" for `n != 1`, which
  reaches the client as a 500; the gateway refuses it first, as a 400 naming the parameter.
- Streams honour `stream_options.include_usage` (a last chunk with `usage` and empty `choices`).
"""

from __future__ import annotations

from typing import ClassVar

from gateway.upstream.providers.selfhosted import SelfHostedProvider


class LlamaCppProvider(SelfHostedProvider):
    kind: ClassVar[str] = "llamacpp"
    system: ClassVar[str] = "openai"  # no well-known gen_ai.provider.name: it speaks the OpenAI API
    health_path: ClassVar[str] = "/health"
    one_choice: ClassVar[bool] = True
