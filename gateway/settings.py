"""The core's configuration: typed, frozen settings for everything on the request path that is not a plugin.

Unknown keys are errors (a typo must not silently disable a feature). The plugins' sections are theirs:
each declares its own models (gateway/plugin.py `Schema`), and gateway/config.py splits the YAML between the
core and the plugins, validates every part and reports every problem at once. Pydantic is used only at
load: the request path reads plain attributes of these frozen objects.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from gateway.state.resp import parse_url


class ConfigError(Exception):
    """Configuration problems, one line each, each naming the file and the YAML path."""

    def __init__(self, *lines: str) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Listen(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)


class Timeouts(Strict):
    connect_s: float = Field(5.0, gt=0)
    first_byte_s: float = Field(600.0, gt=0)  # the response head; LLM prefill can be long
    idle_read_s: float = Field(300.0, gt=0)  # the longest silence between two body chunks


class TlsSettings(Strict):
    verify: bool = True  # false only for a test upstream: it turns off certificate and host checks
    ca_file: str | None = None  # a private CA's certificates (PEM), e.g. for a vLLM behind internal TLS


class OutlierSettings(Strict):
    """Envoy-style outlier detection over one backend's endpoints (gateway/upstream/endpoints.py)."""

    consecutive_failures: int = Field(5, ge=1)  # connect errors, resets or 5xx in a row before an ejection
    base_ejection_s: float = Field(1.0, gt=0)  # the first ejection; doubled for each one after, while it fails
    max_ejection_s: float = Field(30.0, gt=0)
    max_ejected_percent: float = Field(50.0, ge=0, le=100)  # the last healthy endpoint is never ejected


class DiscoverySettings(Strict):
    """Endpoints from a DNS name's A/AAAA records (a Kubernetes headless Service), re-resolved in the background."""

    dns: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    scheme: Literal["http", "https"] = "http"
    path: str = "/v1"
    interval_s: float = Field(10.0, gt=0)


class RoutingSettings(Strict):
    """How a request picks one of its backend's endpoints. `routing: prefix` is short for `{policy: prefix}`."""

    policy: Literal["round_robin", "least_outstanding", "session", "prefix"] = "round_robin"
    session_header: str = "x-session-id"  # session: this header, else the body's `user`
    block_chars: int = Field(512, ge=16)  # prefix: characters per hashed block (~128 tokens), the first four
    max_blocks: int = Field(32, ge=1)  # prefix: how much of the leading prompt is hashed, in block_chars (16 KiB)
    cache_blocks: int = Field(16384, ge=1)  # prefix: block hashes remembered per endpoint (LRU)
    cache_ttl_s: float = Field(600.0, gt=0)  # prefix: a block not sent for this long is taken as evicted
    load_weight: float = Field(1.0, ge=0)  # prefix: blocks of held prompt one request in flight is worth
    kv_weight: float = Field(1.0, ge=0)  # prefix: blocks of held prompt a full KV cache is worth (vLLM metrics)
    max_load_factor: float = Field(3.0, ge=1.0)  # prefix: no endpoint above this times the mean load
    metrics: bool | None = None  # scrape the endpoints' /metrics (vLLM names); default: on for type vllm
    metrics_interval_s: float = Field(1.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _short(cls, value: Any) -> Any:
        return {"policy": value} if isinstance(value, str) else value

    @field_validator("session_header")
    @classmethod
    def _lower(cls, header: str) -> str:
        return header.lower()


class RemoteBackend(Strict):
    # Exactly one of: one URL, a list of replicas' URLs, or a DNS name whose addresses are the replicas.
    base_url: str | None = None
    endpoints: list[str] | None = None
    discovery: DiscoverySettings | None = None
    routing: RoutingSettings = RoutingSettings()
    outlier: OutlierSettings = OutlierSettings()
    api_key: str = ""
    responses_api: bool = True  # false for a server with chat completions only (an older vLLM)
    tls: TlsSettings = TlsSettings()
    headers: dict[str, str] = {}  # sent upstream on every request, e.g. OpenAI-Organization
    timeouts: Timeouts = Timeouts()
    # How Anthropic's Messages API (POST /v1/messages) reaches this backend: passed through to its own
    # /messages ("native"), or translated to chat completions ("translate"). Default: native for the anthropic
    # and llamacpp types, translate for the others (gateway/messages/backends.py).
    messages_api: Literal["native", "translate"] | None = None

    @model_validator(mode="after")
    def _where(self) -> RemoteBackend:
        given = [key for key in ("base_url", "endpoints", "discovery") if getattr(self, key) is not None]
        if len(given) != 1:
            found = f"got {' and '.join(given)}" if given else "none is set"
            raise ValueError(f"set exactly one of base_url, endpoints or discovery, {found}")
        urls = [self.base_url] if self.base_url is not None else self.endpoints or []
        if self.endpoints is not None and not urls:
            raise ValueError("endpoints needs at least one URL")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                key = "base_url" if self.base_url is not None else "endpoints"
                raise ValueError(f"{key} must start with http:// or https://, got {url!r}")
        if len({urlsplit(url).path.rstrip("/") for url in urls}) > 1:
            raise ValueError("every endpoint must have the same path (e.g. all .../v1)")
        if len(set(urls)) != len(urls):
            raise ValueError("an endpoint is listed twice")
        return self

    @property
    def path(self) -> str:
        """The path every endpoint's requests start with, e.g. /v1."""
        if self.discovery is not None:
            return self.discovery.path.rstrip("/")
        return urlsplit((self.endpoints or [self.base_url or ""])[0]).path.rstrip("/")


class OpenAIBackend(RemoteBackend):
    type: Literal["openai"]
    # A Messages request translated for this backend gets a `prompt_cache_key` made from its tenant and its
    # agent's session (x-claude-code-session-id, x-session-id, metadata.user_id), so that one conversation's
    # turns land on the same prompt cache (gateway/messages/backends.py).
    prompt_cache_key: bool = True
    # The Responses API's WebSocket mode upstream: each client socket on /v1/responses gets its own upstream
    # socket here ("auto": used when the upstream serves it, else HTTP; "off": every turn over HTTP).
    websocket: Literal["auto", "off"] = "auto"


class VLLMBackend(RemoteBackend):
    type: Literal["vllm"]


class TGIBackend(RemoteBackend):
    type: Literal["tgi"]  # Hugging Face text-generation-inference, through its Messages API (/v1)


class LlamaCppBackend(RemoteBackend):
    type: Literal["llamacpp"]  # llama.cpp's llama-server, through its OpenAI-compatible /v1 routes


class OllamaBackend(RemoteBackend):
    type: Literal["ollama"]  # Ollama, through its OpenAI-compatible /v1 routes


class AzureBackend(RemoteBackend):
    type: Literal["azure"]
    # A dated version uses /openai/deployments/{deployment}/...; "v1" uses the /openai/v1/ form.
    api_version: str = "2024-10-21"
    websocket: Literal["auto", "off"] = "auto"  # as OpenAIBackend's


class AnthropicBackend(RemoteBackend):
    type: Literal["anthropic"]  # Anthropic's API, or one that speaks it: the Messages API only
    anthropic_version: str = "2023-06-01"  # sent when the client sent no anthropic-version of its own
    responses_api: bool = False

    @model_validator(mode="after")
    def _native(self) -> AnthropicBackend:
        if self.messages_api == "translate":
            raise ValueError("messages_api: translate is not possible here: an anthropic backend has no chat API")
        return self


class SimulatedBackend(Strict):
    type: Literal["simulated"]
    responses_api: bool = True
    ttft_ms: float = Field(150.0, ge=0)
    tpot_ms: float = Field(15.0, ge=0)
    tokens: int = Field(16, ge=1)
    # A scripted share of poor whole chat answers, by kind (gateway/simulation/faults.py): for testing and
    # measuring the checks of the cascade plugin. Set (even to zeros), good answers take the shape asked for.
    failures: dict[Literal["empty", "length", "json", "tool_args", "logprob"], float] | None = None

    @field_validator("failures")
    @classmethod
    def _shares(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None and (any(share < 0 for share in value.values()) or sum(value.values()) > 1.0):
            raise ValueError("failure shares must be at least 0 and add up to at most 1")
        return value


Backend = Annotated[
    OpenAIBackend
    | AzureBackend
    | VLLMBackend
    | TGIBackend
    | LlamaCppBackend
    | OllamaBackend
    | AnthropicBackend
    | SimulatedBackend,
    Field(discriminator="type"),
]


class PoolSettings(Strict):
    max_connections: int = Field(1024, ge=1)  # per backend; Envoy's per-cluster default
    keepalive: int = Field(64, ge=0)  # idle connections kept per backend
    http2: bool = False
    warm_connections: int = Field(4, ge=0)
    keepalive_expiry_s: float = Field(30.0, gt=0)
    pool_timeout_s: float = Field(10.0, gt=0)


class WarmupSettings(Strict):
    """Requests sent to a model's backend before the gateway reports ready, and again when it comes back."""

    requests: int = Field(1, ge=0)
    prompt: str = "Say ok."
    max_tokens: int = Field(1, ge=1)
    timeout_s: float = Field(30.0, gt=0)  # for all of one model's warm-up requests together
    endpoint: Literal["chat/completions", "completions", "embeddings"] = "chat/completions"


class ModelSettings(Strict):
    backend: str
    upstream_model: str | None = None  # default: the public name
    fallback: list[str] = []
    first_token_deadline_ms: float | None = Field(None, gt=0)  # no first token by then -> the next target
    max_attempts: int | None = Field(None, ge=1)  # default: each target once
    max_retry_wait_ms: float = Field(1000.0, ge=0)  # a longer retry-after is left to the client
    warmup: WarmupSettings | None = None
    keep_warm_s: float | None = Field(None, gt=0)  # the cheapest request the server allows, this often
    keep_alive: str | int | None = None  # Ollama's keep_alive on its native API (e.g. "30m", -1 = never unload)


class WebhookSettings(Strict):
    """Signed webhooks for background jobs that ended (gateway/jobs/webhooks.py)."""

    url: str = Field(pattern=r"^https?://")
    secret: str = Field(pattern=r"^whsec_[A-Za-z0-9+/=]{16,}$")  # Standard Webhooks: base64 after the prefix
    max_attempts: int = Field(12, ge=1)
    first_retry_s: float = Field(1.0, gt=0)
    max_retry_s: float = Field(600.0, gt=0)
    timeout_s: float = Field(10.0, gt=0)


class TenantSettings(Strict):
    """A tenant as the core knows it: a name, and where its background jobs' events go. Its keys and limits are
    the plugins' parts of `tenants.NAME`."""

    webhook: WebhookSettings | None = None  # this tenant's jobs' events go here instead of `background.webhook`


class RedisSettings(Strict):
    url: str = ""
    # The request path's deadline per call: past it a cache misses, a rate limit uses its local bound.
    timeout_ms: float = Field(50.0, gt=0)
    # The deadline of calls that decide who may see or change a stored object (they fail closed: a late reply
    # there is a 503), on connections of their own.
    decision_timeout_ms: float = Field(500.0, gt=0)

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        if url:
            parse_url(url)  # a bad scheme, port or database number is a config error, not a failing store
        return url


class TelemetrySettings(Strict):
    exporter: Literal["otlp", "zipkin"] = "otlp"
    otlp_endpoint: str = ""
    zipkin_endpoint: str = Field("", validate_default=True)  # Zipkin's v2 API, e.g. http://zipkin:9411/api/v2/spans
    service_name: str = "sluice"
    sample_ratio: float = Field(1.0, ge=0, le=1)
    max_tenants: int = Field(100, ge=1)  # tenant label values in metrics; the rest are counted as "other"

    @field_validator("zipkin_endpoint")
    @classmethod
    def _zipkin(cls, endpoint: str, info: ValidationInfo) -> str:
        if info.data.get("exporter") == "zipkin" and not endpoint.startswith(("http://", "https://")):
            found = f"got {endpoint!r}" if endpoint else "none is set"
            raise ValueError(
                f"the zipkin exporter needs an http(s) URL such as http://zipkin:9411/api/v2/spans, {found}"
            )
        return endpoint


class LimitSettings(Strict):
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    max_header_bytes: int = Field(64 * 1024, ge=1024)  # request line + headers; over it: 431
    header_timeout_s: float = Field(10.0, gt=0)  # to receive the request head once a request has begun: 408
    body_timeout_s: float = Field(60.0, gt=0)  # the longest silence while receiving the body: 408


class LogSettings(Strict):
    level: Literal["critical", "error", "warning", "info", "debug"] = "info"  # `--log-level` overrides
    format: Literal["text", "json"] = "text"  # `--log-format` overrides
    access: bool = False  # one line per request, after it ended (`--access-log` turns it on)


class ShutdownSettings(Strict):
    grace_s: float = Field(30.0, ge=0)  # requests in flight may finish this long after SIGTERM


class WebSocketSettings(Strict):
    """`responses.websocket`: the Responses API's WebSocket mode (gateway/responses/socket.py)."""

    enabled: bool = True  # false: an upgrade on /v1/responses is refused with a 404, as before
    max_connections: int = Field(1000, ge=1)  # open sockets per process; past it the upgrade gets a 429
    max_per_tenant: int = Field(100, ge=1)  # open sockets per tenant and process; past it a 429
    max_lifetime_s: float = Field(3600.0, gt=0)  # then `websocket_connection_limit_reached`, as OpenAI's 60 minutes
    idle_timeout_s: float = Field(600.0, gt=0)  # a socket with no turn running nor message for this long is closed
    max_message_bytes: int = Field(8 * 1024 * 1024, ge=1024)  # a bigger client message closes the socket: 1009
    max_in_flight: int = Field(16, ge=1)  # responses running or waiting on one socket, as OpenAI's
    max_streams: int = Field(32, ge=1)  # named lanes (`stream_id`) on one socket, as OpenAI's


class ResponsesSettings(Strict):
    # No longer routes anything: an id without an owner record is a 404, never forwarded (accepted so that
    # older configs still load; a warning at start-up says it is ignored).
    default_model: str | None = None
    index_ttl_s: float = Field(30 * 86400.0, gt=0)  # how long the gateway remembers who created a response
    websocket: WebSocketSettings = WebSocketSettings()


class BackgroundSettings(Strict):
    max_inflight_per_tenant: int = Field(16, ge=1)
    ttl_s: float = Field(86400.0, gt=0)  # how long a finished background response can be polled and resumed
    max_events: int = Field(10000, ge=16)  # events kept per response for resuming (approximately)
    max_seconds: float = Field(3600.0, gt=0)  # a gateway-run job still going after this is cancelled
    lease_s: float = Field(10.0, ge=1)  # an owner silent this long is taken as dead: its jobs fail
    # While the store cannot take a job's events, the job keeps them (in order) up to these bounds, then fails;
    # a job whose upstream has ended waits this long for the store before it fails (`store_unavailable`).
    buffer_events: int = Field(4096, ge=16)
    buffer_bytes: int = Field(4 * 1024 * 1024, ge=65536)
    store_wait_s: float = Field(30.0, ge=0)
    webhook: WebhookSettings | None = None  # a signed event posted when a job ends


class ConsoleSettings(Strict):
    """The latency console (`/console` with the admin routes): the last `requests` requests of each process, kept
    in at most `max_bytes`; `enabled: false` keeps nothing and serves no console."""

    enabled: bool = True
    requests: int = Field(10_000, ge=1, le=1_000_000)
    max_bytes: int = Field(64 * 1024 * 1024, ge=65_536)


class AdminSettings(Strict):
    """Where `/status`, `/metrics` and `/readyz`'s detail are served, and to whom (docs/operations.md, "Admin").

    `port` set: on a listener of their own, and no longer on the tenants' port (which keeps `/healthz` and a
    bare `/readyz`). `token` set: a bearer that every request for them must carry, wherever they are served.
    Neither: on the tenants' port only when it listens on a loopback address (the quickstart).
    """

    host: str = "127.0.0.1"
    port: int | None = Field(None, ge=1, le=65535)
    token: str = ""
    console: ConsoleSettings = ConsoleSettings()


class Settings(Strict):
    listen: Listen = Listen()
    admin: AdminSettings = AdminSettings()
    backends: dict[str, Backend]
    pool: PoolSettings = PoolSettings()
    models: dict[str, ModelSettings]
    tenants: dict[str, TenantSettings] = {}
    redis: RedisSettings = RedisSettings()
    telemetry: TelemetrySettings = TelemetrySettings()
    limits: LimitSettings = LimitSettings()
    log: LogSettings = LogSettings()
    shutdown: ShutdownSettings = ShutdownSettings()
    responses: ResponsesSettings = ResponsesSettings()
    background: BackgroundSettings = BackgroundSettings()
    plugins: list[str] = []
    # Each listed plugin's parts of the config, validated by its own schema (set by gateway/config.py).
    _plugin_config: dict[str, Any] = PrivateAttr(default_factory=dict)

    _source: str = PrivateAttr("<config>")  # where the settings were read from, for the start-up summary

    @property
    def source(self) -> str:
        return self._source

    def plugin_config(self, name: str) -> Any:
        """The `Configured` parts of plugin `name`, as the loader validated them."""
        return self._plugin_config[name]


def references(settings: Settings) -> list[tuple[str, str]]:
    """Problems between the core's sections: names that point nowhere."""
    problems: list[tuple[str, str]] = []
    for name, model in settings.models.items():
        if model.backend not in settings.backends:
            problems.append((f"models.{name}.backend", f"no backend named {model.backend!r}"))
        backend = settings.backends.get(model.backend)
        if model.keep_alive is not None and backend is not None and backend.type != "ollama":
            problems.append(
                (f"models.{name}.keep_alive", f"only Ollama reads keep_alive; {model.backend} is {backend.type}")
            )
        for other in model.fallback:
            if other == name:
                problems.append((f"models.{name}.fallback", "a model cannot fall back to itself"))
            elif other not in settings.models:
                problems.append((f"models.{name}.fallback", f"no model named {other!r}"))
    if not settings.models:
        problems.append(("models", "at least one model is needed"))
    default = settings.responses.default_model
    if default is not None and default not in settings.models:
        problems.append(("responses.default_model", f"no model named {default!r}"))
    return problems
