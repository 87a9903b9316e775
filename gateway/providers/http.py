"""What the HTTP backends share: warm pools to the backend's endpoints and a request written from pre-built bytes.

Everything that does not change between requests (the path prefix, the credential header, the static
headers) is serialised once here; a request adds only its target path, its ids and its body. The
client's own credentials and headers are never forwarded: the backend's are injected instead. Which
endpoint (replica) a request goes to is the backend's route policy's choice (gateway/endpoints.py, route.py).
"""

from __future__ import annotations

import logging
import ssl
from typing import TYPE_CHECKING, ClassVar

import orjson

from gateway import route
from gateway.endpoints import Endpoints
from gateway.pool import PoolLimits
from gateway.settings import ConfigError

if TYPE_CHECKING:
    from gateway.context import Exchange, Target
    from gateway.providers.base import UpstreamResponse
    from gateway.settings import PoolSettings, RemoteBackend

log = logging.getLogger("sluice.upstream")


def header_lines(headers: dict[str, str]) -> bytes:
    return b"".join(f"{name}: {value}\r\n".encode("latin-1") for name, value in headers.items())


def tls_context(name: str, backend: RemoteBackend) -> ssl.SSLContext:
    """Built once per backend: the handshake is paid at warm-up, the context's set-up never again."""
    try:
        context = ssl.create_default_context(cafile=backend.tls.ca_file)
    except (OSError, ssl.SSLError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"backends.{name}.tls.ca_file: cannot load {backend.tls.ca_file}: {reason}") from None
    if not backend.tls.verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class HttpProvider:
    kind: ClassVar[str] = "openai"
    system: ClassVar[str] = "openai"

    def __init__(self, name: str, backend: RemoteBackend, pool: PoolSettings) -> None:
        self.name = name
        self.base_path = backend.path
        self.limits = PoolLimits(
            max_connections=pool.max_connections,
            max_idle=pool.keepalive,
            warm=pool.warm_connections,
            connect_timeout=backend.timeouts.connect_s,
            pool_timeout=pool.pool_timeout_s,
            first_byte_timeout=backend.timeouts.first_byte_s,
            idle_read_timeout=backend.timeouts.idle_read_s,
            keepalive_expiry=pool.keepalive_expiry_s,
        )
        static = {"content-type": "application/json", "accept-encoding": "identity", "user-agent": "sluice"}
        static.update(self.auth_headers(backend.api_key))
        static.update({k.lower(): v for k, v in backend.headers.items()})
        self.static_headers = header_lines(static)
        urls = [backend.base_url] if backend.base_url is not None else backend.endpoints or []
        https = backend.discovery.scheme == "https" if backend.discovery is not None else urls[0].startswith("https")
        spec = backend.discovery
        # The backend's address as configured (spans' server.address when no endpoint was chosen).
        self.url = urls[0].rstrip("/") if spec is None else f"{spec.scheme}://{spec.dns}:{spec.port}{self.base_path}"
        self.ssl = tls_context(name, backend) if https else None
        self.endpoints = Endpoints(name, backend, self.limits, self.ssl, pool.http2)
        # One fixed endpoint has nothing to choose from: no policy, no routing work per request.
        alone = backend.discovery is None and len(urls) == 1
        self.route: route.Policy | None = None if alone else route.build(backend.routing, self.endpoints.fresh_s)

    def auth_headers(self, api_key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {api_key}"} if api_key else {}

    def path(self, ex: Exchange, target: Target) -> bytes:
        return f"{self.base_path}/{ex.endpoint}".encode()

    def body(self, ex: Exchange, target: Target) -> bytes:
        if target.upstream_model == ex.model:
            return ex.body
        # Renaming the model is the one change we make to a body; the parsed JSON is shared, so copy it.
        return orjson.dumps({**ex.json, "model": target.upstream_model})

    async def start(self) -> None:
        await self.endpoints.start()

    @property
    def ready(self) -> bool:
        return self.endpoints.ready

    async def send(self, ex: Exchange, target: Target) -> UpstreamResponse:
        headers = self.static_headers + b"x-request-id: " + ex.request_id.encode() + b"\r\n"
        if ex.traceparent is not None:
            headers += b"traceparent: " + ex.traceparent + b"\r\n"
        return await self.endpoints.send(ex, self.route, self.path(ex, target), headers, self.body(ex, target))

    async def aclose(self) -> None:
        await self.endpoints.aclose()
