"""Azure OpenAI: the deployment in the path, `api-version` in the query, the key in `api-key`.

With a dated `api_version` requests go to `/openai/deployments/{deployment}/{endpoint}?api-version=...`;
with `api_version: v1` to `/openai/v1/{endpoint}` with the deployment as the body's model. The Responses
API has no deployment in its path in either form: `/openai/responses?api-version=...` (a preview version,
2025-03-01-preview or later) or `/openai/v1/responses`, the deployment named by the body's model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar
from urllib.parse import quote

from gateway.upstream.providers.http import HttpProvider, request_body

if TYPE_CHECKING:
    from gateway.context import Exchange, Target
    from gateway.settings import AzureBackend, PoolSettings


USAGE_SINCE = "2024-09-01"


class AzureProvider(HttpProvider):
    kind: ClassVar[str] = "azure"
    system: ClassVar[str] = "azure.ai.openai"

    def __init__(self, name: str, backend: AzureBackend, pool: PoolSettings) -> None:
        super().__init__(name, backend, pool)
        self.v1 = backend.api_version == "v1"
        root = self.root = self.base_path.removesuffix("/openai").rstrip("/")
        self.prefix = f"{root}/openai/v1/" if self.v1 else f"{root}/openai/deployments/"
        self.query = "" if self.v1 else f"?api-version={quote(backend.api_version)}"
        self._paths: dict[tuple[str, str], bytes] = {}
        # Dated versions before 2024-09-01 reject `stream_options`: their streams' tokens are estimated.
        self.reports_usage = self.v1 or backend.api_version[:10] >= USAGE_SINCE

    def auth_headers(self, api_key: str) -> dict[str, str]:
        return {"api-key": api_key} if api_key else {}

    def path(self, ex: Exchange, target: Target) -> bytes:
        if ex.endpoint == "responses":
            if self.v1:
                return f"{self.prefix}responses{ex.resource}".encode()
            resource, _, query = ex.resource.partition("?")
            query = self.query + ("&" + query if query else "")
            return f"{self.root}/openai/responses{resource}{query}".encode()
        key = (target.upstream_model, ex.endpoint)
        path = self._paths.get(key)
        if path is None:
            if self.v1:
                path = f"{self.prefix}{ex.endpoint}".encode()
            else:
                path = f"{self.prefix}{quote(target.upstream_model, safe='')}/{ex.endpoint}{self.query}".encode()
            self._paths[key] = path
        return path

    def body(self, ex: Exchange, target: Target) -> bytes:
        # The deployment path selects the model; only the v1 form and Responses read the body's model.
        return (
            super().body(ex, target)
            if self.v1 or ex.endpoint == "responses"
            else request_body(
                ex, None, self.reports_usage, None if ex.upstream_fields is None else ex.upstream_fields.get(self.name)
            )
        )
