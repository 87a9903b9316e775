"""Anthropic's API (`type: anthropic`): the Messages API only, with the key as `x-api-key`.

Messages requests reach it through gateway/messages/backends.py's passthrough, which writes the request
line and body itself (the client's bytes, `anthropic-version` and `anthropic-beta`). Here is what the
provider does on its own: authenticate with `x-api-key`, send the warm-up (a one-message body that is a
valid Messages request as it is) to `/messages`, and refuse OpenAI-shaped requests with a 400 that says
where to send them (a 502 when it is only a fallback, so the attempt loop passes over it), rather than
forward them to an API that has no such route.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from gateway import errors
from gateway.upstream.providers.http import HttpProvider

if TYPE_CHECKING:
    from gateway.context import Exchange, Target
    from gateway.settings import AnthropicBackend, PoolSettings
    from gateway.upstream.providers.base import UpstreamResponse

WARMUP = "warmup-"  # the request id of the gateway's own warm-up requests (gateway/upstream/warmup.py)


class AnthropicProvider(HttpProvider):
    kind: ClassVar[str] = "anthropic"
    system: ClassVar[str] = "anthropic"

    def __init__(self, name: str, backend: AnthropicBackend, pool: PoolSettings) -> None:
        super().__init__(name, backend, pool)
        self.version = backend.anthropic_version

    def auth_headers(self, api_key: str) -> dict[str, str]:
        return {"x-api-key": api_key} if api_key else {}

    async def send(self, ex: Exchange, target: Target) -> UpstreamResponse:
        if not ex.request_id.startswith(WARMUP):
            message = (
                f"model {target.model!r} is served by backend {target.backend!r} (type anthropic), which has "
                "Anthropic's Messages API only: send it to POST /v1/messages"
            )
            if ex.targets and target is not ex.targets[0]:
                # A fallback that cannot serve this API: passed over like a failed target, never a 400 that
                # would hide why the targets before it failed.
                raise errors.UpstreamError(message, code="messages_only")
            raise errors.BadRequestError(message, param="model", code="messages_only")
        headers = self.static_headers + b"anthropic-version: " + self.version.encode() + b"\r\n"
        path = f"{self.base_path}/messages".encode()
        return await self.endpoints.send(ex, self.route, b"POST", path, headers, self.body(ex, target))
