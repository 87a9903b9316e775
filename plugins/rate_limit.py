"""rate_limit: requests and tokens per minute, per tenant and optionally per tenant and model, as OpenAI does.

Each limit is a token bucket: capacity = the per-minute limit, refilled at limit/60 per second. A request
takes 1 from every requests bucket that applies and, from every tokens bucket, a reservation: the prompt
estimated from the body size (`len(body) // 4`, no tokenizer on the request path) plus the completion
allowed (`max_completion_tokens`, `max_tokens`, else `rate_limit.default_max_tokens`; times `n`). It is
admitted only if every bucket has room, and then all of them are charged at once. After the last byte the
tokens buckets are corrected from the real `usage.total_tokens` (a refund, or a charge when the estimate
was low); a failed request without usage gets back its completion part; an answer made by a plugin (a
cache hit) gets back everything; a stream that completed without usage (no `stream_options.include_usage`)
keeps its reservation.

Why a token bucket rather than a sliding window: its state is one number per bucket (O(1), where a
sliding log grows with the traffic and a window counter needs two keys and an interpolation), capacity
comes back smoothly instead of at window edges, one Lua script checks and charges every bucket of a
request in one round trip so the limit is exact across workers and instances, and "time until the
bucket is full again" is exactly what OpenAI's `x-ratelimit-reset-*` headers report.

The state of a bucket is the time at which it will be full again (`full_at`): its level is
`limit - (full_at - now) * rate`, taking `c` moves `full_at` forward by `c / rate`, and a request fits while
`full_at - now` stays within the period. A missing key is a full bucket, so each key expires (PEXPIRE) at
the moment its bucket would be full: idle tenants leave nothing behind. With Redis (`redis.url`) the script
runs there with Redis `TIME` as the clock shared by every instance; without it, or while it is down, the
same buckets run in this process, so limits are then per process. The limiter never fails a request
because its store is down.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, cast

from pydantic import Field

from gateway.errors import RateLimitError
from gateway.plugin import Configured, Empty, Problem, Schema
from gateway.settings import Strict
from gateway.store import Script, Store, StoreUnavailable

if TYPE_CHECKING:
    from gateway.context import Exchange
    from gateway.plugin import Outcome, ResponseHead
    from gateway.runtime import Runtime
    from gateway.settings import Settings

NAME = "rate_limit"


class Limits(Strict):
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)


class TenantLimits(Limits):
    models: dict[str, Limits] = Field(default_factory=dict)  # per tenant and model, on top of the tenant-wide limits


class RateLimitSection(Strict):
    """`rate_limit:`"""

    # Tokens reserved at admission for a request that sets no max_tokens; corrected from usage afterwards.
    default_max_tokens: int = Field(1024, ge=1)


class RateLimitTenant(Strict):
    """Its key under `tenants.NAME`."""

    rate_limit: TenantLimits = TenantLimits()


Config = Configured[RateLimitSection, Empty, RateLimitTenant]
PERIOD_MS = 60_000  # the limits are per minute
REQUESTS = "requests"
TOKENS = "tokens"
ABBREVIATION = {REQUESTS: "RPM", TOKENS: "TPM"}
HEADERS = {
    kind: tuple(f"x-ratelimit-{part}-{kind}".encode() for part in ("limit", "remaining", "reset"))
    for kind in (REQUESTS, TOKENS)
}

# KEYS: the buckets. ARGV[1]: "1" to charge without checking (corrections, which may be negative), then per
# bucket: limit, period (ms), cost. Charges every bucket only if all of them have room. Returns
# {admitted, then per bucket: remaining (whole tokens, may be negative after a correction), ms until full,
# ms to wait before this cost fits}: integers, since Redis truncates Lua numbers.
SOURCE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local force = ARGV[1] == '1'
local starts, ends = {}, {}
local admitted = 1
for i = 1, #KEYS do
  local limit, period, cost = tonumber(ARGV[3*i-1]), tonumber(ARGV[3*i]), tonumber(ARGV[3*i+1])
  local full_at = tonumber(redis.call('GET', KEYS[i])) or now
  if full_at < now then full_at = now end
  starts[i] = full_at
  ends[i] = full_at + cost * period / limit
  if not force and ends[i] - now > period then admitted = 0 end
end
local out = {admitted}
for i = 1, #KEYS do
  local limit, period = tonumber(ARGV[3*i-1]), tonumber(ARGV[3*i])
  local full_at = starts[i]
  if admitted == 1 then
    full_at = math.max(ends[i], now)
    local ttl = math.ceil(full_at - now)
    if ttl > 0 then
      redis.call('SET', KEYS[i], string.format('%.3f', full_at), 'PX', ttl)
    else
      redis.call('DEL', KEYS[i])
    end
  end
  out[#out + 1] = math.floor((period - (full_at - now)) * limit / period)
  out[#out + 1] = math.ceil(full_at - now)
  out[#out + 1] = math.max(0, math.ceil(ends[i] - now - period))
end
return out
"""
SCRIPT = Script(SOURCE)


@dataclass(frozen=True, slots=True)
class Bucket:
    key: str
    kind: str  # REQUESTS or TOKENS
    limit: int
    scope: str  # who it limits, for the 429 message
    limit_header: bytes = field(init=False)  # the limit as the header value, made once

    def __post_init__(self) -> None:
        object.__setattr__(self, "limit_header", str(self.limit).encode())


@dataclass(frozen=True, slots=True)
class Plan:
    """The buckets one (tenant, model) pair is checked against, with what each check needs made once."""

    buckets: tuple[Bucket, ...]
    keys: tuple[str, ...] = ()
    requests: tuple[int, ...] = ()  # indices of the requests buckets
    tokens: tuple[int, ...] = ()  # indices of the tokens buckets
    token_keys: tuple[str, ...] = ()
    template: tuple[int, ...] = ()  # the check's ARGV, token costs left at 0

    @classmethod
    def of(cls, buckets: tuple[Bucket, ...]) -> Plan:
        template = [0]
        for bucket in buckets:
            template += (bucket.limit, PERIOD_MS, 1 if bucket.kind == REQUESTS else 0)
        tokens = tuple(i for i, b in enumerate(buckets) if b.kind == TOKENS)
        return cls(
            buckets,
            keys=tuple(b.key for b in buckets),
            requests=tuple(i for i, b in enumerate(buckets) if b.kind == REQUESTS),
            tokens=tokens,
            token_keys=tuple(buckets[i].key for i in tokens),
            template=tuple(template),
        )

    def check_args(self, reserved: int) -> list[int]:
        args = list(self.template)
        for i in self.tokens:
            # A reservation larger than the whole bucket waits for a full bucket instead of never fitting;
            # the correction charges the rest, so one big request cannot lock a tenant out for good.
            args[3 * i + 3] = min(reserved, self.buckets[i].limit)
        return args

    def correction_args(self, reserved: int, actual: int) -> list[int] | None:
        """ARGV that moves each tokens bucket from what was charged to `actual`; None when nothing moves."""
        args = [1]
        moved = False
        for i in self.tokens:
            limit = self.buckets[i].limit
            delta = actual - min(reserved, limit)
            moved = moved or delta != 0
            args += (limit, PERIOD_MS, delta)
        return args if moved else None


@dataclass(slots=True)
class Reservation:
    """What on_request admitted, kept in ex.state for the headers and the correction."""

    plan: Plan
    verdict: list[int]
    reserved: int  # tokens: prompt estimate + completion allowed
    completion: int  # the completion part, refunded when a request fails without usage
    local: bool  # decided by the in-process buckets (Redis absent or down)


@dataclass(slots=True)
class LocalBuckets:
    """The script's buckets in this process: used without Redis and while it is down. Limits are per process."""

    clock: Callable[[], float] = time.monotonic  # seconds; injectable for tests
    full_at: dict[str, float] = field(default_factory=dict)  # key -> clock ms when full again; absent: full

    def take(self, keys: Sequence[str], args: Sequence[int]) -> list[int]:
        """The script's semantics and result, same arguments. Keys come from the config, so this stays small."""
        now = self.clock() * 1000.0
        force = args[0] == 1
        starts: list[float] = []
        ends: list[float] = []
        admitted = 1
        for i, key in enumerate(keys):
            limit, period, cost = args[3 * i + 1], args[3 * i + 2], args[3 * i + 3]
            start = max(self.full_at.get(key, now), now)
            starts.append(start)
            ends.append(start + cost * period / limit)
            if not force and ends[i] - now > period:
                admitted = 0
        out = [admitted]
        for i, key in enumerate(keys):
            limit, period = args[3 * i + 1], args[3 * i + 2]
            full_at = starts[i]
            if admitted:
                full_at = max(ends[i], now)  # a refund never fills a bucket beyond its capacity
                if full_at > now:
                    self.full_at[key] = full_at
                else:
                    self.full_at.pop(key, None)
            out += (
                math.floor((period - (full_at - now)) * limit / period),
                math.ceil(full_at - now),
                max(0, math.ceil(ends[i] - now - period)),
            )
        return out


def go_duration(ms: int) -> str:
    """A duration as Go prints it, as OpenAI's reset headers do: `120ms`, `6s`, `1.5s`, `1m0s`, `1h0m0s`."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    seconds, millis = divmod(ms, 1000)
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    text = f"{seconds}.{millis:03d}".rstrip("0") if millis else str(seconds)
    if hours:
        return f"{hours}h{minutes}m{text}s"
    if minutes:
        return f"{minutes}m{text}s"
    return f"{text}s"


def ratelimit_headers(plan: Plan, verdict: list[int]) -> list[tuple[bytes, bytes]]:
    """OpenAI's x-ratelimit-* headers; with a tenant and a model bucket of a kind, the one with less left."""
    headers: list[tuple[bytes, bytes]] = []
    for kind, indices in ((REQUESTS, plan.requests), (TOKENS, plan.tokens)):
        if not indices:
            continue
        i = indices[0]
        for j in indices[1:]:
            if verdict[3 * j + 1] < verdict[3 * i + 1]:
                i = j
        limit, remaining, reset = HEADERS[kind]
        headers += (
            (limit, plan.buckets[i].limit_header),
            (remaining, str(max(0, verdict[3 * i + 1])).encode()),
            (reset, go_duration(verdict[3 * i + 2]).encode()),
        )
    return headers


def rejection(plan: Plan, verdict: list[int], reserved: int) -> RateLimitError:
    """The 429 for a refused check, named after the bucket that needs the longest wait, as OpenAI words it."""
    i = max(range(len(plan.buckets)), key=lambda j: verdict[3 * j + 3])
    bucket = plan.buckets[i]
    wait_ms = max(1, verdict[3 * i + 3])
    requested = 1 if bucket.kind == REQUESTS else reserved
    message = (
        f"Rate limit reached for {bucket.scope} on {bucket.kind} per min ({ABBREVIATION[bucket.kind]}): "
        f"Limit {bucket.limit}, Used {bucket.limit - verdict[3 * i + 1]}, Requested {requested}. "
        f"Please try again in {go_duration(wait_ms)}."
    )
    headers = [
        (b"retry-after", str(max(1, math.ceil(wait_ms / 1000))).encode()),
        (b"retry-after-ms", str(wait_ms).encode()),
        *ratelimit_headers(plan, verdict),
    ]
    return RateLimitError(message, type=bucket.kind, headers=headers)


def estimate(ex: Exchange, default_max_tokens: int) -> tuple[int, int]:
    """(tokens to reserve, the completion part of them), from the body alone."""
    prompt = len(ex.body) // 4
    if ex.endpoint == "embeddings":
        return prompt, 0
    body = ex.json
    allowed = body.get("max_completion_tokens")
    if allowed is None:
        allowed = body.get("max_tokens", body.get("max_output_tokens"))
    if type(allowed) is not int or allowed < 1:
        allowed = default_max_tokens  # an invalid value is refused upstream and refunded
    n = body.get("n")
    completion: int = allowed * n if type(n) is int and n > 1 else allowed
    return prompt + completion, completion


def actual_tokens(outcome: Outcome, reservation: Reservation) -> int | None:
    """What the request really cost in tokens, or None to keep the reservation as it is."""
    if outcome.source not in ("upstream", "error"):
        return 0  # a plugin answered (a cache hit): it used no upstream capacity, so only the request counts
    usage = outcome.usage
    total = usage.get("total_tokens") if usage is not None else None
    if type(total) is int and total >= 0:
        return total
    if outcome.complete and outcome.status < 400:
        return None  # served, but the upstream said nothing about usage: the reservation is the best bound
    return reservation.reserved - reservation.completion


def _buckets(limits: Limits, prefix: str, scope: str) -> tuple[Bucket, ...]:
    found = []
    if limits.requests_per_minute is not None:
        found.append(Bucket(prefix + REQUESTS, REQUESTS, limits.requests_per_minute, scope))
    if limits.tokens_per_minute is not None:
        found.append(Bucket(prefix + TOKENS, TOKENS, limits.tokens_per_minute, scope))
    return tuple(found)


def build_plans(config: Config, models: Iterable[str]) -> dict[tuple[str, str], Plan]:
    """A plan for every (tenant, model) that has a limit; a pair without one is unlimited and costs a lookup."""
    plans: dict[tuple[str, str], Plan] = {}
    for tenant, spec in config.tenants.items():
        limits = spec.rate_limit
        # The {tenant} hash tag keeps one request's keys in one Redis Cluster slot, as the script requires.
        prefix = f"sluice:rl:{{{tenant}}}:"
        tenant_wide = _buckets(limits, prefix, f"tenant {tenant}")
        for model in models:
            per_model = limits.models.get(model)
            buckets = tenant_wide
            if per_model is not None:
                buckets += _buckets(per_model, f"{prefix}model:{model}:", f"{model} in tenant {tenant}")
            if buckets:
                plans[(tenant, model)] = Plan.of(buckets)
    return plans


class RateLimit:
    """The plugin: checks and charges in on_request, reports in on_response, corrects in on_complete."""

    name: ClassVar[str] = NAME
    # After auth: a limit is per tenant, and only auth knows who is calling.
    schema: ClassVar[Schema] = Schema(section=RateLimitSection, tenant=RateLimitTenant, after=("auth",))

    @classmethod
    def check(cls, config: Config, settings: Settings, listed: Sequence[str]) -> Iterable[Problem]:
        for tenant, spec in config.tenants.items():
            for model in spec.rate_limit.models:
                if model not in settings.models:
                    yield f"tenants.{tenant}.rate_limit.models.{model}", f"no model named {model!r}"
            limited = spec.rate_limit.requests_per_minute or spec.rate_limit.tokens_per_minute or spec.rate_limit.models
            if limited and "auth" not in listed and tenant != "anonymous":
                yield (
                    f"tenants.{tenant}.rate_limit",
                    f"limits tenant {tenant!r}, but without the `auth` plugin (listed before `rate_limit`) every "
                    "caller is tenant 'anonymous'",
                )

    def __init__(self, config: Config, settings: Settings, clock: Callable[[], float] = time.monotonic) -> None:
        self.plans = build_plans(config, settings.models)
        self.default_max_tokens = config.section.default_max_tokens
        self.local = LocalBuckets(clock)
        self.store: Store | None = None
        self.fallbacks = 0  # checks and corrections made in process because Redis was unavailable
        self.limited: Any = None  # sluice_rate_limited_total, made at start-up
        self.tenant_label: Callable[[str], str] = str

    async def startup(self, runtime: Runtime) -> None:
        self.tenant_label = runtime.meter.tenant
        self.limited = runtime.meter.counter(
            "sluice_rate_limited_total",
            "Requests the gateway rejected with 429 before any upstream was tried.",
            ("tenant", "model"),
        )
        if runtime.store is None or not self.plans:
            return
        self.store = runtime.store
        # If Redis is down now, the first check that reaches it loads the script (NOSCRIPT path).
        with contextlib.suppress(StoreUnavailable):
            await self.store.execute("SCRIPT", "LOAD", SCRIPT.source)

    async def on_request(self, ex: Exchange) -> None:
        plan = self.plans.get((ex.tenant, ex.model))
        if plan is None or ex.resource:  # reading or cancelling a stored response generates nothing
            return
        reserved, completion = estimate(ex, self.default_max_tokens) if plan.tokens else (0, 0)
        verdict, local = await self._take(plan.keys, plan.check_args(reserved), local=False)
        if not verdict[0]:
            if self.limited is not None:
                self.limited.labels(self.tenant_label(ex.tenant), ex.model).inc()
            raise rejection(plan, verdict, reserved)
        ex.state[NAME] = Reservation(plan, verdict, reserved, completion, local)

    async def on_response(self, ex: Exchange, head: ResponseHead) -> None:
        reservation: Reservation | None = ex.state.get(NAME)
        if reservation is not None:
            head.headers += ratelimit_headers(reservation.plan, reservation.verdict)

    async def on_complete(self, ex: Exchange, outcome: Outcome) -> None:
        reservation: Reservation | None = ex.state.get(NAME)
        if reservation is None or not reservation.plan.tokens:
            return
        actual = actual_tokens(outcome, reservation)
        if actual is None:
            return
        args = reservation.plan.correction_args(reservation.reserved, actual)
        if args is not None:
            await self._take(reservation.plan.token_keys, args, local=reservation.local)

    async def _take(self, keys: Sequence[str], args: list[int], *, local: bool) -> tuple[list[int], bool]:
        """Run the script in Redis, else (no Redis, Redis down, or `local`) on the in-process buckets."""
        if self.store is not None and not local:
            try:
                return cast("list[int]", await self.store.run(SCRIPT, keys, args)), False
            except StoreUnavailable:
                self.fallbacks += 1
        return self.local.take(keys, args), True
