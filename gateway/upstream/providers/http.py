"""What the HTTP backends share: warm pools to the backend's endpoints and a request written from pre-built bytes.

Everything that does not change between requests (the path prefix, the credential header, the static
headers) is serialised once here; a request adds only its target path, its ids and its body. The
client's own credentials and headers are never forwarded: the backend's are injected instead. Which
endpoint (replica) a request goes to is the backend's route policy's choice (gateway/upstream/endpoints.py, route.py).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import orjson

from gateway.settings import ConfigError
from gateway.upstream import route
from gateway.upstream.endpoints import Endpoints
from gateway.upstream.health import Health
from gateway.upstream.pool import PoolLimits

if TYPE_CHECKING:
    from prometheus_client import Gauge

    from gateway.context import Exchange, Target
    from gateway.settings import PoolSettings, RemoteBackend
    from gateway.upstream.providers.base import UpstreamResponse

log = logging.getLogger("sluice.upstream")

STREAM_OPTIONS = b'{"stream_options":{"include_usage":true},'


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


def request_body(ex: Exchange, model: str | None, usage: bool, extra: Mapping[str, Any] | None = None) -> bytes:
    """The body to send: as the client sent it, unless the model is renamed, a stream must report usage or a
    plugin adds fields for this backend (`extra`: the request's priority).

    A stream is always asked for its usage (`stream_options.include_usage`), so that tokens, TPOT and the
    rate limiter's correction work for clients that did not ask; the relay hides the usage chunk from them.
    """
    inject = usage and ex.stream and not ex.include_usage
    if model is None and not inject and extra is None:
        return ex.body
    if model is None and extra is None and "stream_options" not in ex.json:
        # The common case, a plain stream: one field in front of the others, no re-serialisation.
        body = ex.body if ex.body[:1] == b"{" else ex.body.lstrip()
        return STREAM_OPTIONS + memoryview(body)[1:]  # one copy, however large the prompt
    # The parsed JSON is shared with the plugins, so copy it.
    data = {**ex.json}
    if model is not None:
        data["model"] = model
    if inject:
        options = data.get("stream_options")
        data["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    if extra is not None:
        data.update(extra)
    return orjson.dumps(data)


class HttpProvider:
    kind: ClassVar[str] = "openai"
    system: ClassVar[str] = "openai"
    # Whether a stream can be asked for its usage (`stream_options.include_usage`); without it the relay
    # counts events instead.
    reports_usage = True
    # Whether a whole answer with `n > 1` has the usage of its first choice only (the accounting estimates
    # the others: server/relay.py's all_choices_usage).
    usage_of_first_choice = False

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
        spec = backend.discovery
        # The backend's address as configured (spans' server.address when no endpoint was chosen).
        self.url = urls[0].rstrip("/") if spec is None else f"{spec.scheme}://{spec.dns}:{spec.port}{self.base_path}"
        self.ssl = tls_context(name, backend) if self.url.startswith("https://") else None
        self.health = Health(name)
        self.endpoints = Endpoints(name, backend, self.limits, self.ssl, self.health, pool.http2)
        # One fixed endpoint has nothing to choose from: no policy, no routing work per request.
        alone = spec is None and len(urls) == 1
        self.route: route.Policy | None = None if alone else route.build(backend.routing, self.endpoints.fresh_s)

    def auth_headers(self, api_key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {api_key}"} if api_key else {}

    def path(self, ex: Exchange, target: Target) -> bytes:
        return f"{self.base_path}/{ex.endpoint}{ex.resource}".encode()

    def body(self, ex: Exchange, target: Target) -> bytes:
        model = target.upstream_model if target.upstream_model != ex.model else None
        fields = ex.upstream_fields
        return request_body(ex, model, self.reports_usage, None if fields is None else fields.get(self.name))

    async def start(self) -> None:
        await self.endpoints.start()

    @property
    def ready(self) -> bool:
        return self.health.state != "warming"

    async def send(self, ex: Exchange, target: Target) -> UpstreamResponse:
        headers = self.static_headers + b"x-request-id: " + ex.request_id.encode() + b"\r\n"
        if ex.traceparent is not None:
            headers += b"traceparent: " + ex.traceparent + b"\r\n"
        # A stored response's operations (retrieve, delete, cancel) carry no body of their own.
        body = b"" if ex.resource else self.body(ex, target)
        return await self.endpoints.send(ex, self.route, ex.method, self.path(ex, target), headers, body)

    def report(self) -> dict[str, Any]:
        """The backend's state for /status; with several endpoints (replicas), each one's too."""
        report = self.health.report()
        if len(self.endpoints.urls) > 1 or self.endpoints.discovery is not None:
            report["endpoints"] = self.endpoints.report()
        return report

    def instrument(self, gauge: Gauge) -> None:
        self.endpoints.instrument(gauge)

    def in_service(self) -> int:
        return len(self.endpoints.live)

    def endpoint_urls(self) -> list[str]:
        """The base URLs of the endpoints in service (the admission plugin reads their engines' capacity)."""
        return [endpoint.url for endpoint in self.endpoints.live]

    async def aclose(self) -> None:
        await self.endpoints.aclose()
