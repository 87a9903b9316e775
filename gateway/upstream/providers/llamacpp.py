"""llama.cpp's `llama-server`: `/v1/chat/completions`, `/v1/completions` and `/v1/embeddings` in the OpenAI format.

What is its own (ggml-org/llama.cpp, tools/server/README.md, "GET /health"; the parameter schema of the
server, `n_cmpl` and its alias `n`):
- The HTTP server starts before the model is loaded. Until it is, `GET /health` (also `/v1/health`, never
  behind the API key) answers 503 `{"error": {"code": 503, "message": "Loading model", "type":
  "unavailable_error"}}`, and so do the completion routes; then 200 `{"status": "ok"}`. The backend is
  `loading` meanwhile: requests go to their fallbacks first, and a 503 that still gets through is retried on
  the next target like any 503.
- `n` (an alias of `n_cmpl`) may be up to the server's slot count (`-np`); above it the server answers 400
  "Field 'n': Value must be between 1 <= value <= N", relayed as it is: the gateway does not know the bound.
  The choices run side by side in their own slots. A whole answer's `usage.completion_tokens` counts the
  first choice only, so the accounting estimates the others (`usage_of_first_choice`); a stream sends one
  usage-only chunk per choice, which the relay sums.
- Streams honour `stream_options.include_usage` (a last chunk with `usage` and empty `choices`, with
  llama.cpp's `timings`); `usage.prompt_tokens_details.cached_tokens` is the prompt-cache reuse.
"""

from __future__ import annotations

from typing import ClassVar

from gateway.upstream.providers.selfhosted import SelfHostedProvider


class LlamaCppProvider(SelfHostedProvider):
    kind: ClassVar[str] = "llamacpp"
    system: ClassVar[str] = "openai"  # no well-known gen_ai.provider.name: it speaks the OpenAI API
    health_path: ClassVar[str] = "/health"
    usage_of_first_choice = True
