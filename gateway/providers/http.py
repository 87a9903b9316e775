"""What the HTTP backends share: a warm pool to one origin and a request written from pre-built bytes.

Everything that does not change between requests (the path prefix, the credential header, the static
headers) is serialised once here; a request adds only its target path, its ids and its body. The
client's own credentials and headers are never forwarded: the backend's are injected instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from typing import TYPE_CHECKING, ClassVar
from urllib.parse import urlsplit

import orjson

from gateway.http2 import Http2Client
from gateway.pool import Pool, PoolError, PoolLimits
from gateway.settings import ConfigError

if TYPE_CHECKING:
    from gateway.context import Exchange, Target
    from gateway.providers.base import UpstreamResponse
    from gateway.settings import PoolSettings, RemoteBackend

log = logging.getLogger("sluice.upstream")

MAINTAIN_INTERVAL_S = 5.0


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
        self.url = backend.base_url.rstrip("/")
        self.base_path = urlsplit(self.url).path
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
        self.ssl = tls_context(name, backend) if self.url.startswith("https://") else None
        self.http2 = pool.http2
        self.pool: Pool | None = None
        self.client: Pool | Http2Client | None = None
        self._maintainer: asyncio.Task[None] | None = None
        self._ready = False

    def auth_headers(self, api_key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {api_key}"} if api_key else {}

    def path(self, ex: Exchange, target: Target) -> bytes:
        return f"{self.base_path}/{ex.endpoint}{ex.resource}".encode()

    def body(self, ex: Exchange, target: Target) -> bytes:
        if target.upstream_model == ex.model:
            return ex.body
        # Renaming the model is the one change we make to a body; the parsed JSON is shared, so copy it.
        return orjson.dumps({**ex.json, "model": target.upstream_model})

    async def start(self) -> None:
        if self.http2:
            self.client = Http2Client(self.url, self.limits, self.ssl)
        else:
            self.pool = self.client = Pool(self.url, self.limits, self.ssl)
        try:
            warm = await self.client.warm() if self.limits.warm else 0
        except PoolError as exc:
            warm = 0
            log.warning("backend %s: warm-up failed: %s", self.name, exc)
        self._ready = warm >= min(self.limits.warm, 1) or self.limits.warm == 0
        if self._ready:
            log.info("backend %s: %d warm connection(s) to %s", self.name, warm, self.url)
        if self.pool is not None:
            self._maintainer = asyncio.get_running_loop().create_task(self.pool.maintain(MAINTAIN_INTERVAL_S))

    @property
    def ready(self) -> bool:
        # Ready once warm; a backend that was down at start-up becomes ready when the keep-warm loop connects.
        return self._ready or (self.pool is not None and self.pool.size > 0)

    async def send(self, ex: Exchange, target: Target) -> UpstreamResponse:
        assert self.client is not None, "provider not started"
        headers = self.static_headers + b"x-request-id: " + ex.request_id.encode() + b"\r\n"
        if ex.traceparent is not None:
            headers += b"traceparent: " + ex.traceparent + b"\r\n"
        # A stored response's operations (retrieve, delete, cancel) carry no body of their own.
        body = b"" if ex.resource else self.body(ex, target)
        response = await self.client.request(ex.method, self.path(ex, target), headers, body)
        self._ready = True
        return response

    async def aclose(self) -> None:
        if self._maintainer is not None:
            self._maintainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintainer
        if self.client is not None:
            await self.client.aclose()
