"""The limiter: the plugin's hooks, admission from leases or local buckets, the corrections afterwards.

The package's docstring says how it works. Apart from `__init__` so that it can be compiled (mypyc runs a
compiled package `__init__` before its `__path__` is set, so it could not import its interpreted submodules).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from gateway.plugin import Configured, Empty, Problem, Schema
from gateway.state.store import StoreUnavailable
from plugins.rate_limit.buckets import (
    REQUESTS,
    TOKENS,
    Bucket,
    LocalBuckets,
    Plan,
    ratelimit_headers,
    rejection,
)
from plugins.rate_limit.concurrency import Concurrency
from plugins.rate_limit.config import Limits, RateLimitSection, RateLimitTenant
from plugins.rate_limit.sync import SCRIPT, Leases, Route

if TYPE_CHECKING:
    from gateway.context import Exchange
    from gateway.plugin import Outcome
    from gateway.runtime import Runtime
    from gateway.settings import Settings


NAME = "rate_limit"
INFLIGHT = "rate_limit.inflight"  # ex.state: the tenant whose request this process counts as in flight


Config = Configured[RateLimitSection, Empty, RateLimitTenant]


@dataclass(slots=True, init=False)  # __init__ written out: compiled, a dataclass's own is interpreted
class Reservation:
    """What on_request admitted, kept in ex.state for the headers and the correction."""

    plan: Plan
    verdict: list[int]
    reserved: int  # tokens: prompt estimate + completion allowed
    completion: int  # the completion part, refunded when a request fails without usage
    route: Route | None  # the leases it was admitted from; None: decided by the in-process buckets

    def __init__(self, plan: Plan, verdict: list[int], reserved: int, completion: int, route: Route | None) -> None:
        self.plan = plan
        self.verdict = verdict
        self.reserved = reserved
        self.completion = completion
        self.route = route


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
    usage = outcome.usage
    total = usage.get("total_tokens") if usage is not None else None
    if type(total) is int and total >= 0:
        return total  # what upstreams spent, whoever called them (a plugin's reply may say too: the cascade)
    if outcome.source not in ("upstream", "error"):
        return 0  # a plugin answered (a cache hit): it used no upstream capacity, so only the request counts
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


# The model of a stored object's operation until its owner is read (gateway/responses/api.py), which
# happens after this plugin: such an operation is charged to its tenant's requests buckets only.
STORED = ""


def read_plans(config: Config) -> dict[tuple[str, str], Plan]:
    """A plan per tenant with a requests limit, for reads and cancels of stored objects: one request from the
    tenant-wide requests bucket (the same bucket every other request of the tenant takes from), no tokens."""
    plans: dict[tuple[str, str], Plan] = {}
    for tenant, spec in config.tenants.items():
        limits = spec.rate_limit
        if limits.requests_per_minute is not None:
            key = f"sluice:rl:{{{tenant}}}:" + REQUESTS  # as build_plans names it: one bucket for both
            bucket = Bucket(key, REQUESTS, limits.requests_per_minute, f"tenant {tenant}")
            plans[(tenant, STORED)] = Plan.of((bucket,))
    return plans


class RateLimit:
    """The plugin: admits in on_request (its headers set there), corrects in on_complete."""

    name: ClassVar[str] = NAME
    # After auth: a limit is per tenant, and only auth knows who is calling.
    schema: ClassVar[Schema] = Schema(section=RateLimitSection, tenant=RateLimitTenant, after=("auth",))

    @classmethod
    def check(cls, config: Config, settings: Settings, listed: Sequence[str]) -> Iterable[Problem]:
        for tenant, spec in config.tenants.items():
            for model in spec.rate_limit.models:
                if model not in settings.models:
                    yield f"tenants.{tenant}.rate_limit.models.{model}", f"no model named {model!r}"
            limits = spec.rate_limit
            limited = limits.requests_per_minute or limits.tokens_per_minute or limits.models
            if limited and "auth" not in listed and tenant != "anonymous":
                yield (
                    f"tenants.{tenant}.rate_limit",
                    f"limits tenant {tenant!r}, but without the `auth` plugin (listed before `rate_limit`) every "
                    "caller is tenant 'anonymous'",
                )

    def __init__(self, config: Config, settings: Settings, clock: Callable[[], float] = time.monotonic) -> None:
        self.plans = {**build_plans(config, settings.models), **read_plans(config)}
        default = config.section.max_concurrent or max(1, settings.pool.max_connections // 2)
        caps = {name: t.max_concurrent for name, t in config.tenants.items() if t.max_concurrent is not None}
        self.concurrency = Concurrency(caps, default)
        self.default_max_tokens = config.section.default_max_tokens
        self.lease_settings = config.section
        self.clock = clock
        self.local = LocalBuckets(clock)
        self.leases: Leases | None = None
        self.fallbacks = 0  # admissions and corrections made in process because Redis was unavailable
        self.limited: Any = None  # sluice_rate_limited_total, made at start-up
        self.tenant_label: Callable[[str], str] = str

    @property
    def syncs(self) -> int:
        """Script calls made to Redis: admissions per sync is the batching the leases achieve."""
        return self.leases.syncs if self.leases is not None else 0

    async def startup(self, runtime: Runtime) -> None:
        self.tenant_label = runtime.meter.tenant
        self.limited = runtime.meter.counter(
            "sluice_rate_limited_total",
            "Requests the gateway rejected with 429 before any upstream was tried.",
            ("tenant", "model"),
        )
        if runtime.store is None or not self.plans:
            return
        s = self.lease_settings
        self.leases = Leases(
            self.plans,
            runtime.store,
            share=s.lease_share,
            ttl_s=s.lease_ttl_s,
            wait_ms=s.sync_wait_ms,
            clock=self.clock,
        )
        # If Redis is down now, the first sync that reaches it loads the script (NOSCRIPT path).
        with contextlib.suppress(StoreUnavailable):
            await runtime.store.execute("SCRIPT", "LOAD", SCRIPT.source)

    async def shutdown(self) -> None:
        if self.leases is not None:
            await self.leases.aclose()  # unused units go back to the shared buckets now, not at lapse

    def on_request(self, ex: Exchange) -> Awaitable[None] | None:
        # Reading or cancelling a stored object generates nothing, but costs a request like any other (its
        # model is STORED until the owner is read, after this plugin): a tenant cannot read without limit.
        # A plain method: its answer is a coroutine only when the leases lack room and a sync must be waited
        # for (the pipeline awaits it then); while leases last, no coroutine is made and run for a request.
        tenant = ex.tenant
        self.concurrency.enter(tenant)  # first: a request refused here is charged nothing
        ex.state[INFLIGHT] = tenant
        key = (tenant, ex.model)
        plan = self.plans.get(key)
        if plan is None:
            return None
        reserved, completion = estimate(ex, self.default_max_tokens) if plan.tokens else (0, 0)
        leases = self.leases
        if leases is None:
            verdict = self.local.take(plan.keys, plan.check_args(reserved))
            self._decided(ex, plan, verdict, reserved, completion, None)
            return None
        route = leases.routes[key]
        costs = plan.costs(reserved)
        found = leases.admit_now(route, costs)
        if found is None:
            return self._synced(ex, leases, plan, route, costs, (reserved, completion))
        self._decided(ex, plan, found, reserved, completion, route)
        return None

    async def _synced(
        self, ex: Exchange, leases: Leases, plan: Plan, route: Route, costs: list[int], tokens: tuple[int, int]
    ) -> None:
        """The leases lacked room: the verdict after a sync, or in process while Redis is unavailable."""
        reserved, completion = tokens
        try:
            verdict = await leases.admit(route, costs)
        except StoreUnavailable:
            self.fallbacks += 1
            self._decided(ex, plan, self.local.take(plan.keys, plan.check_args(reserved)), reserved, completion, None)
            return
        self._decided(ex, plan, verdict, reserved, completion, route)

    def _decided(
        self, ex: Exchange, plan: Plan, verdict: list[int], reserved: int, completion: int, route: Route | None
    ) -> None:
        if not verdict[0]:
            if self.limited is not None:
                self.limited.labels(self.tenant_label(ex.tenant), ex.model).inc()
            self._leave(ex)  # refused: it is not in flight
            raise rejection(plan, verdict, reserved)
        ex.state[NAME] = Reservation(plan, verdict, reserved, completion, route)
        # Known now, whatever answers: the response carries them without an on_response hook.
        ex.add_response_headers(ratelimit_headers(plan, verdict))

    def _leave(self, ex: Exchange) -> None:
        tenant = ex.state.pop(INFLIGHT, None)
        if tenant is not None:
            self.concurrency.leave(tenant)

    def on_complete(self, ex: Exchange, outcome: Outcome) -> None:
        self._leave(ex)  # after the last byte: a stream counts until its end
        reservation: Reservation | None = ex.state.get(NAME)
        if reservation is None or not reservation.plan.tokens:
            return
        actual = actual_tokens(outcome, reservation)
        if actual is None:
            return
        plan = reservation.plan
        if reservation.route is not None and self.leases is not None:
            # Folded into the next sync of these buckets: no round trip per request.
            for i in plan.tokens:
                delta = actual - min(reservation.reserved, plan.buckets[i].limit)
                if delta:
                    self.leases.correct(reservation.route, delta, (i,))
            return
        # A reservation made in process is corrected in process.
        args = plan.correction_args(reservation.reserved, actual)
        if args is not None:
            self.local.take(plan.token_keys, args)
