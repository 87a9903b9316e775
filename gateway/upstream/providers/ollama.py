"""Ollama, through its OpenAI-compatible routes: `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`.

What is its own (ollama/ollama: docs/api.md for the native API, docs/openai.md for the /v1 routes):
- Models are loaded on the first request that names them and unloaded after `keep_alive` of idleness (5
  minutes unless the request or OLLAMA_KEEP_ALIVE says otherwise). The first request after an unload pays the
  load. `POST /api/generate {"model": M}` with no prompt loads a model and answers at once with
  `"done": true`, generating nothing: the cheapest request that keeps it resident, and what `keep_warm_s`
  sends. With the model's `keep_alive` setting it carries `"keep_alive"` ("30m", or -1: never unload).
- The /v1 routes are not given `keep_alive`: the compatibility layer has no such field, and adding one would
  mean rewriting every body. Each /v1 request resets the idle timer to the server's default, so a model that
  must stay resident longer uses `keep_warm_s` (each ping sets its `keep_alive` again).
- Health: `GET /api/version` answers once the server is up (there is no loading state for the server: a
  model loads per request). `GET /api/ps` lists the models in memory: kept in `resident` at every check.
- `n` is not supported (one choice per request): refused here with a 400. Streams honour
  `stream_options.include_usage`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import httpx

from gateway.upstream.providers.selfhosted import SelfHostedProvider

if TYPE_CHECKING:
    from gateway.settings import PoolSettings, RemoteBackend


class OllamaProvider(SelfHostedProvider):
    kind: ClassVar[str] = "ollama"
    system: ClassVar[str] = "openai"  # no well-known gen_ai.provider.name: it speaks the OpenAI API
    health_path: ClassVar[str] = "/api/version"
    one_choice: ClassVar[bool] = True

    def __init__(self, name: str, backend: RemoteBackend, pool: PoolSettings) -> None:
        super().__init__(name, backend, pool)
        self.resident: frozenset[str] = frozenset()  # models in memory at the last check (GET /api/ps)

    async def probe(self, http: httpx.AsyncClient, root: str) -> tuple[str, str]:
        server, detail = await super().probe(http, root)
        if server == "up" and root == self.roots[0]:  # the models in memory of the first endpoint
            response = await http.get(root + "/api/ps")
            models: list[object] = []
            try:
                if response.status_code == 200:
                    models = response.json().get("models") or []
            except (ValueError, AttributeError):
                models = []  # an answer we cannot read says nothing about which models are loaded
            self.resident = frozenset(str(m.get("name") or m.get("model")) for m in models if isinstance(m, dict))
        return server, detail

    def report(self) -> dict[str, Any]:
        return {**super().report(), "resident": sorted(self.resident)}

    async def keep_warm(self, model: str, keep_alive: str | int | None, timeout_s: float) -> None:
        """Load `model` if it is not in memory, and keep it there for `keep_alive` (the server's default if None).

        Raises httpx.HTTPError when the server cannot be reached or refuses (an unknown model: 404)."""
        assert self._http is not None, "provider not started"
        body: dict[str, object] = {"model": model}
        if keep_alive is not None:
            body["keep_alive"] = keep_alive
        for root in self.roots:  # every replica keeps it resident, whichever the next request goes to
            response = await self._http.post(root + "/api/generate", json=body, timeout=timeout_s)
            response.raise_for_status()
        self.resident = self.resident | {model}
