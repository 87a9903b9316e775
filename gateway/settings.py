"""The configuration: YAML in, frozen typed settings out, checked once at start-up.

Unknown keys are errors (a typo must not silently disable a feature). `${NAME}` and `${NAME:-default}`
are expanded from the environment inside string values before validation. Pydantic is used only here:
the request path reads plain attributes of these frozen objects.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DEFAULT_PATH = Path("config/gateway.yaml")
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-(.*?))?\}")

QUICKSTART_YAML = """
backends:
  sim: {type: simulated, ttft_ms: 150, tpot_ms: 15}
models:
  chat-large: {backend: sim, upstream_model: large, fallback: [chat-small]}
  chat-small: {backend: sim, upstream_model: small}
auth: {required: false}
"""


class ConfigError(Exception):
    """A configuration problem, said in one line that names the YAML path."""


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


class RemoteBackend(Strict):
    base_url: str
    api_key: str = ""
    responses_api: bool = True  # false for a server with chat completions only (an older vLLM)
    tls: TlsSettings = TlsSettings()
    headers: dict[str, str] = {}  # sent upstream on every request, e.g. OpenAI-Organization
    timeouts: Timeouts = Timeouts()

    @model_validator(mode="after")
    def _url(self) -> RemoteBackend:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        return self


class OpenAIBackend(RemoteBackend):
    type: Literal["openai"]


class VLLMBackend(RemoteBackend):
    type: Literal["vllm"]


class AzureBackend(RemoteBackend):
    type: Literal["azure"]
    # A dated version uses /openai/deployments/{deployment}/...; "v1" uses the /openai/v1/ form.
    api_version: str = "2024-10-21"


class SimulatedBackend(Strict):
    type: Literal["simulated"]
    responses_api: bool = True
    ttft_ms: float = Field(150.0, ge=0)
    tpot_ms: float = Field(15.0, ge=0)
    tokens: int = Field(16, ge=1)


Backend = Annotated[OpenAIBackend | AzureBackend | VLLMBackend | SimulatedBackend, Field(discriminator="type")]


class PoolSettings(Strict):
    max_connections: int = Field(256, ge=1)
    keepalive: int = Field(64, ge=0)  # idle connections kept per backend
    http2: bool = False
    warm_connections: int = Field(4, ge=0)
    keepalive_expiry_s: float = Field(30.0, gt=0)
    pool_timeout_s: float = Field(10.0, gt=0)


class SloSettings(Strict):
    ttft_p95_ms: float = Field(800.0, gt=0)
    max_error_rate: float = Field(0.05, ge=0, le=1)
    window_s: float = Field(30.0, gt=0)
    min_samples: int = Field(20, ge=1)
    probe_ratio: float = Field(0.05, ge=0, le=1)  # share of traffic that keeps trying a degraded primary
    cooldown_s: float = Field(10.0, ge=0)  # the least time spent degraded
    recovery_samples: int = Field(5, ge=1)  # good probes in a row needed to return
    recovery_margin: float = Field(0.8, gt=0, le=1)  # probes must beat the SLO by this factor (hysteresis)


CacheMode = Literal["deterministic", "always", "off"]


class CacheSettings(Strict):
    ttl_s: float = Field(3600.0, gt=0)
    l1_entries: int = Field(10000, ge=0)
    l1_bytes: int = Field(64 * 1024 * 1024, ge=0)
    max_entry_bytes: int = Field(1024 * 1024, ge=1)  # larger answers are not stored
    stale_s: float = Field(3600.0, ge=0)  # how long past its TTL an entry may still answer when every target fails
    mode: CacheMode = "deterministic"
    max_followers: int = Field(256, ge=0)  # identical in-flight requests sharing one upstream call
    follower_wait_s: float = Field(30.0, gt=0)  # how long a follower waits for the leader's first byte


class ModelCache(Strict):
    """Per-model overrides of the cache policy."""

    mode: CacheMode | None = None
    ttl_s: float | None = Field(None, gt=0)
    shared: bool = False  # entries shared by all tenants (only for models whose answers are not private)


class ModelSettings(Strict):
    backend: str
    upstream_model: str | None = None  # default: the public name
    fallback: list[str] = []
    first_token_deadline_ms: float | None = Field(None, gt=0)
    slo: SloSettings | None = None
    hedge_after_ms: float | None = Field(None, gt=0)
    max_hedge_ratio: float = Field(0.1, ge=0, le=1)
    max_attempts: int | None = Field(None, ge=1)  # default: each target once
    max_retry_wait_ms: float = Field(1000.0, ge=0)  # a longer retry-after is left to the client
    cache: ModelCache = ModelCache()


class Limits(Strict):
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)


class RateLimitSettings(Limits):
    models: dict[str, Limits] = {}  # per tenant and model, on top of the tenant-wide limits


class RateLimiterSettings(Strict):
    # Tokens reserved at admission for a request that sets no max_tokens; corrected from usage afterwards.
    default_max_tokens: int = Field(1024, ge=1)


class TenantSettings(Strict):
    keys: list[Annotated[str, Field(pattern=r"^sha256:[0-9a-fA-F]{64}$")]] = []
    models: list[str] | None = None  # None: every model
    rate_limit: RateLimitSettings = RateLimitSettings()


class RedisSettings(Strict):
    url: str = ""


class AuthSettings(Strict):
    required: bool = True
    cache_ttl_s: float = Field(30.0, gt=0)


class TelemetrySettings(Strict):
    otlp_endpoint: str = ""
    service_name: str = "sluice"
    sample_ratio: float = Field(1.0, ge=0, le=1)
    max_tenants: int = Field(100, ge=1)  # tenant label values in metrics; the rest are counted as "other"


class LimitSettings(Strict):
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)


class ResponsesSettings(Strict):
    default_model: str | None = None  # serves retrievals of response ids the gateway did not see created
    index_ttl_s: float = Field(30 * 86400.0, gt=0)  # how long the gateway remembers who created a response


class BackgroundSettings(Strict):
    max_inflight_per_tenant: int = Field(16, ge=1)
    ttl_s: float = Field(86400.0, gt=0)  # how long a finished background response can be polled and resumed
    max_events: int = Field(10000, ge=16)  # events kept per response for resuming (approximately)
    max_seconds: float = Field(3600.0, gt=0)  # a gateway-run job still going after this is cancelled
    lease_s: float = Field(10.0, ge=1)  # an owner silent this long is taken as dead: its jobs fail


class Settings(Strict):
    listen: Listen = Listen()
    backends: dict[str, Backend]
    pool: PoolSettings = PoolSettings()
    models: dict[str, ModelSettings]
    tenants: dict[str, TenantSettings] = {}
    redis: RedisSettings = RedisSettings()
    auth: AuthSettings = AuthSettings()
    rate_limit: RateLimiterSettings = RateLimiterSettings()
    cache: CacheSettings = CacheSettings()
    telemetry: TelemetrySettings = TelemetrySettings()
    limits: LimitSettings = LimitSettings()
    responses: ResponsesSettings = ResponsesSettings()
    background: BackgroundSettings = BackgroundSettings()
    plugins: list[str] = []

    @model_validator(mode="after")
    def _references(self) -> Settings:
        for name, model in self.models.items():
            if model.backend not in self.backends:
                raise ValueError(f"models.{name}.backend: no backend named {model.backend!r}")
            if model.slo is not None and not model.fallback:
                raise ValueError(f"models.{name}.slo: an SLO needs a fallback to degrade to")
            if model.hedge_after_ms is not None and not model.fallback:
                raise ValueError(f"models.{name}.hedge_after_ms: hedging needs a fallback to race")
            for other in model.fallback:
                if other not in self.models:
                    raise ValueError(f"models.{name}.fallback: no model named {other!r}")
                if other == name:
                    raise ValueError(f"models.{name}.fallback: a model cannot fall back to itself")
        if not self.models:
            raise ValueError("models: at least one model is needed")
        default = self.responses.default_model
        if default is not None and default not in self.models:
            raise ValueError(f"responses.default_model: no model named {default!r}")
        return self


def expand_env(value: Any) -> Any:
    """Replace ${NAME} and ${NAME:-default} in every string of a parsed YAML tree."""
    if isinstance(value, str):
        return ENV_REF.sub(_env_value, value)
    if isinstance(value, dict):
        return {key: expand_env(item) for key, item in value.items()}
    if isinstance(value, list):
        return [expand_env(item) for item in value]
    return value


def _env_value(match: re.Match[str]) -> str:
    name, default = match.group(1), match.group(2)
    if name in os.environ and (default is None or os.environ[name]):
        return os.environ[name]
    if default is not None:
        return default
    raise ConfigError(f"environment variable {name} is not set (use ${{{name}:-default}} for a default)")


def parse(text: str, source: str = "<config>") -> Settings:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {' '.join(str(exc).split())}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    try:
        return Settings.model_validate(expand_env(raw))
    except ValidationError as exc:
        raise ConfigError(f"{source}: {_first_error(exc)}") from exc


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    # Discriminated unions put the tag in the location ("backends.x.openai.api_key"): keep the YAML path.
    path = ".".join(str(part) for part in error["loc"] if part not in ("openai", "azure", "vllm", "simulated"))
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        message = "unknown key"
    return f"{path}: {message}" if path else message


def load(path: str | os.PathLike[str] | None = None) -> Settings:
    """The settings from `path`, else $SLUICE_CONFIG, else config/gateway.yaml, else the built-in quickstart."""
    if path is None:
        path = os.environ.get("SLUICE_CONFIG") or (DEFAULT_PATH if DEFAULT_PATH.exists() else None)
    if path is None:
        return parse(QUICKSTART_YAML, "<built-in quickstart>")
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    return parse(text, str(path))
