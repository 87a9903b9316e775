"""Hugging Face text-generation-inference (TGI), through its Messages API: `/v1/chat/completions`.

What is its own (huggingface/text-generation-inference: docs/source/messages_api.md, the Messages API from
TGI 1.4; docs/source/reference/api_reference.md and the router's OpenAPI description for `/health` and `/info`):
- `GET /health` answers 200 once the model answers, 503 when it does not. The launcher starts the HTTP router
  only after the shards have loaded the model, so a TGI that is still loading refuses connections: `down`
  until it listens, then `up`.
- `GET /info` says which model it serves and its limits (`model_id`, `max_input_tokens`, `max_total_tokens`;
  `max_input_length` in versions before 2.1). It is read each time the server comes up, logged and kept in
  `info`, so that a status page can show it.
- A TGI server serves one model: the body's `model` is not used to choose it ("tgi" in its examples).
- `n` is accepted but unused (one choice per request): refused here with a 400 rather than answered with one.
- Streams honour `stream_options.include_usage` (TGI 2.3 and later).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

from gateway.upstream.providers.selfhosted import SelfHostedProvider

if TYPE_CHECKING:
    import httpx

    from gateway.settings import PoolSettings, RemoteBackend

log = logging.getLogger("sluice.upstream")
INFO_FIELDS = ("model_id", "max_input_tokens", "max_input_length", "max_total_tokens", "version")


class TGIProvider(SelfHostedProvider):
    kind: ClassVar[str] = "tgi"
    system: ClassVar[str] = "openai"  # no well-known gen_ai.provider.name: it speaks the OpenAI API
    health_path: ClassVar[str] = "/health"
    one_choice: ClassVar[bool] = True

    def __init__(self, name: str, backend: RemoteBackend, pool: PoolSettings) -> None:
        super().__init__(name, backend, pool)
        self.info: dict[str, Any] = {}

    def report(self) -> dict[str, Any]:
        return {**super().report(), "info": self.info}

    async def on_up(self, http: httpx.AsyncClient, root: str) -> None:
        response = await http.get(root + "/info")
        if response.status_code != 200:
            return
        body = response.json()
        if isinstance(body, dict):
            self.info = {key: body[key] for key in INFO_FIELDS if key in body}
            shown = ", ".join(f"{key}={value}" for key, value in self.info.items())
            log.info("backend %s: TGI serves %s", self.name, shown or "(no details)")
