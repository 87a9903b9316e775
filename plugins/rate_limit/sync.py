"""This process's leases on the shared buckets, and the one Lua script that settles and renews them in Redis.

Admission takes from the leases without a round trip. A lease running low is renewed in the background; all
the buckets of one tenant are synced by one script call, one call in flight per tenant at a time (their keys
share the `{tenant}` hash tag, so the call stays in one Redis Cluster slot and is atomic). A request whose
lease is empty waits for a sync, at most `wait_ms`, then is decided here from what the process last learnt of
the shared bucket. Unused units and token corrections go back with the next sync; a timer makes that sync
when the lease lapses, so an idle process gives back what it holds within `ttl`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

from gateway.state.store import Script, Store, StoreUnavailable
from plugins.rate_limit.buckets import PERIOD_MS, Plan
from plugins.rate_limit.lease import Lease

log = logging.getLogger("sluice.rate_limit")

# KEYS: one tenant's buckets. ARGV per bucket: limit, period (ms), settle, want, need. The state of a bucket is
# the time at which it will be full again (`full_at`, Redis TIME, shared by every instance; a missing key is a
# full bucket). `settle` is charged (+) or given back (-) unconditionally, a give-back never filling the bucket
# beyond its capacity; then min(want, level) units are granted, unless that is fewer than `need`, in which case
# none are. Each key expires when its bucket would be full. Returns per bucket: granted, ms until full (the
# level left, to the millisecond: beyond the period after a correction that overdrew it), ms until `need` fits.
SOURCE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local out = {}
for i = 1, #KEYS do
  local limit, period = tonumber(ARGV[5*i-4]), tonumber(ARGV[5*i-3])
  local settle, want, need = tonumber(ARGV[5*i-2]), tonumber(ARGV[5*i-1]), tonumber(ARGV[5*i])
  local per = period / limit
  local full_at = tonumber(redis.call('GET', KEYS[i])) or now
  full_at = math.max(full_at + settle * per, now)
  local level = math.floor((period - (full_at - now)) / per)
  local grant = math.max(0, math.min(want, level))
  local wait = 0
  if grant < need then
    grant = 0
    wait = math.ceil(full_at + need * per - now - period)
  end
  full_at = full_at + grant * per
  local ttl = math.ceil(full_at - now)
  if ttl > 0 then
    redis.call('SET', KEYS[i], string.format('%.3f', full_at), 'PX', ttl)
  else
    redis.call('DEL', KEYS[i])
  end
  out[#out + 1] = grant
  out[#out + 1] = math.max(0, ttl)
  out[#out + 1] = math.max(0, wait)
end
return out
"""
SCRIPT = Script(SOURCE)


@dataclass(slots=True)
class Group:
    """One tenant's buckets: synced together, one sync in flight at a time."""

    keys: list[str] = field(default_factory=list)
    leases: list[Lease] = field(default_factory=list)
    inflight: asyncio.Task[bool] | None = None
    timer: asyncio.TimerHandle | None = None


@dataclass(frozen=True, slots=True)
class Route:
    """What one (tenant, model) pair is checked against: its plan, and the leases on the plan's buckets."""

    plan: Plan
    group: Group
    leases: tuple[Lease, ...]


class Leases:
    def __init__(
        self,
        plans: dict[tuple[str, str], Plan],
        store: Store,
        *,
        share: float,
        ttl_s: float,
        wait_ms: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.clock = clock
        self.ttl_ms = ttl_s * 1000.0
        self.wait_ms = wait_ms
        self.routes: dict[tuple[str, str], Route] = {}
        self.groups: dict[str, Group] = {}
        by_key: dict[str, Lease] = {}
        for (tenant, model), plan in plans.items():
            group = self.groups.setdefault(tenant, Group())
            leases = []
            for bucket in plan.buckets:
                lease = by_key.get(bucket.key)
                if lease is None:
                    cap = max(1, math.floor(share * bucket.limit))
                    lease = by_key[bucket.key] = Lease(bucket.limit, cap, self.ttl_ms)
                    group.keys.append(bucket.key)
                    group.leases.append(lease)
                leases.append(lease)
            self.routes[(tenant, model)] = Route(plan, group, tuple(leases))
        self.syncs = 0  # script calls made
        self.credits = 0  # requests decided here because a sync was late

    def now(self) -> float:
        return self.clock() * 1000.0

    def admit_now(self, route: Route, costs: list[int]) -> list[int] | None:
        """The verdict from the leases alone, or None when one of them lacks room (then `admit`)."""
        # _take, Lease.take and _admitted written out, and the pairs walked by index: this is every admission's
        # path while leases last, and each call saved is about a thousand instructions (compiled, a
        # `zip(..., strict=True)` is a generic call with a keyword: about 2.5k to 5k a request each).
        leases = route.leases
        count = len(leases)
        if len(costs) != count:
            raise ValueError(f"{len(costs)} costs for {count} leases")
        for i in range(count):
            if leases[i].free < costs[i]:
                return None
        now = self.clock() * 1000.0
        renew = False
        for i in range(count):
            lease = leases[i]
            cost = costs[i]
            lease.free -= cost
            lease.used += cost
            lease.hits += 1
            if lease.free < lease.low:
                renew = True
        if renew and route.group.inflight is None:
            self._start(route.group, renew=True)  # in the background: this request is admitted already
        verdict = [1]
        for lease in leases:  # after the sync is sent, as it changes what is known (see Lease.outgoing)
            # Lease.report written out, as above.
            # (Floats throughout: compiled, a sum of an int and a float typed as either is boxed arithmetic.)
            limit, per_ms = lease.limit, lease.per_ms
            level = lease.level + (now - lease.level_at) * per_ms
            known = (float(limit) if level > limit else level) + float(lease.free - lease.settle)
            remaining = limit if known >= limit else math.floor(known)
            full = math.ceil((limit - remaining) / per_ms)
            verdict.append(remaining)
            verdict.append(full if full > 0 else 0)
            verdict.append(0)
        return verdict

    async def admit(self, route: Route, costs: Sequence[int]) -> list[int]:
        """The verdict once the leases lack room: refused on what is known, or after a sync, or on credit.

        Raises StoreUnavailable when Redis is, so that the caller decides with its in-process buckets.
        """
        now = self.now()
        deadline = now + self.wait_ms
        group = route.group
        while True:
            lacking = [(lease, cost) for lease, cost in zip(route.leases, costs, strict=True) if lease.free < cost]
            if not lacking:
                return self._take(route, costs, now)
            if any(lease.fresh(now) and lease.known(now) < cost for lease, cost in lacking):
                return self._refused(route.leases, costs, now)
            if not self.store.available:
                return self._unavailable(route, costs, now, "redis circuit open")
            for lease, cost in lacking:
                lease.need = max(lease.need, cost - lease.free)
            if group.inflight is None:
                self._start(group, renew=True)
            sync = group.inflight
            left = deadline - now
            if sync is None or left <= 0:
                return self._on_credit(route, costs, now)
            try:
                ok = await asyncio.wait_for(asyncio.shield(sync), left / 1000.0)
            except TimeoutError:
                return self._on_credit(route, costs, self.now())
            now = self.now()
            if not ok:
                return self._unavailable(route, costs, now, "redis sync failed")

    def correct(self, route: Route, delta: int, indices: Sequence[int]) -> None:
        """Fold a token correction into the next sync of the buckets at `indices`."""
        for i in indices:
            route.leases[i].settle += delta
        self._arm(route.group, self.now())

    async def aclose(self) -> None:
        """Give back every lease and send what is owed, one call per tenant, before the store closes."""
        for group in self.groups.values():
            if group.timer is not None:
                group.timer.cancel()
                group.timer = None
        await asyncio.gather(*(g.inflight for g in self.groups.values() if g.inflight is not None))
        if not self.store.available:
            return  # what is held lapses in Redis by itself
        for group in self.groups.values():
            for lease in group.leases:
                lease.expires = 0.0  # lapse now
            self._start(group, renew=False)
        await asyncio.gather(*(g.inflight for g in self.groups.values() if g.inflight is not None))
        for group in self.groups.values():
            if group.timer is not None:
                group.timer.cancel()
                group.timer = None

    def _take(self, route: Route, costs: Sequence[int], now: float) -> list[int]:
        renew = False
        for lease, cost in zip(route.leases, costs, strict=True):
            lease.take(cost)
            renew = renew or lease.free < lease.low
        if renew and route.group.inflight is None:
            self._start(route.group, renew=True)  # in the background: this request is admitted already
        return self._admitted(route.leases, now)

    def _admitted(self, leases: Sequence[Lease], now: float) -> list[int]:
        verdict = [1]
        for lease in leases:
            verdict += lease.report(now)
        return verdict

    def _refused(self, leases: Sequence[Lease], costs: Sequence[int], now: float) -> list[int]:
        verdict = [0]
        for lease, cost in zip(leases, costs, strict=True):
            remaining, full, _ = lease.report(now)
            verdict += (remaining, full, 0 if lease.free >= cost else lease.wait(now, cost))
        return verdict

    def _unavailable(self, route: Route, costs: Sequence[int], now: float, why: str) -> list[int]:
        """Redis cannot be asked: decide on credit from what is known while it is fresh, else say so (raise
        StoreUnavailable), so that the caller decides with its in-process buckets."""
        if all(lease.fresh(now) for lease in route.leases):
            return self._on_credit(route, costs, now)
        raise StoreUnavailable(why)

    def _on_credit(self, route: Route, costs: Sequence[int], now: float) -> list[int]:
        """A sync is late: decide from what this process knows, and charge what it admits at the next sync."""
        if any(lease.free < cost and lease.known(now) < cost for lease, cost in zip(route.leases, costs, strict=True)):
            return self._refused(route.leases, costs, now)
        self.credits += 1
        for lease, cost in zip(route.leases, costs, strict=True):
            if lease.free >= cost:
                lease.take(cost)
            else:
                lease.owe(cost)
        self._arm(route.group, now)
        return self._admitted(route.leases, now)

    def _start(self, group: Group, *, renew: bool) -> None:
        now = self.now()
        keys: list[str] = []
        args: list[int] = []
        sent: list[Lease] = []
        for key, lease in zip(group.keys, group.leases, strict=True):
            out = lease.outgoing(now, renew)
            if out is not None:
                keys.append(key)
                args += (lease.limit, PERIOD_MS, *out)
                sent.append(lease)
        if sent:
            group.inflight = asyncio.ensure_future(self._sync(group, keys, args, sent))

    async def _sync(self, group: Group, keys: list[str], args: list[int], sent: list[Lease]) -> bool:
        self.syncs += 1
        try:
            result = cast("list[int]", await self.store.run(SCRIPT, keys, args))
            now = self.now()
            for i, lease in enumerate(sent):
                lease.granted(now, int(result[3 * i]), int(result[3 * i + 1]))
        except Exception as exc:
            if not isinstance(exc, StoreUnavailable):  # the store logs its own outages; anything else is a bug
                log.exception("rate_limit: sync failed; deciding in process until the next one")
            now = self.now()
            retry_ms = max(0.0, self.store.retry_in_s()) * 1000.0
            for lease in group.leases:
                lease.failed(now, retry_ms)
            return False
        finally:
            group.inflight = None
        self._arm(group, now)
        return True

    def _arm(self, group: Group, now: float) -> None:
        """Make sure a sync comes when a lease lapses or something is owed, if none is due before."""
        if group.timer is not None:
            return
        due = math.inf
        for lease in group.leases:
            if lease.free:
                due = min(due, lease.expires)
            if lease.settle:
                due = min(due, now + self.ttl_ms)
        if due < math.inf:
            loop = asyncio.get_running_loop()
            group.timer = loop.call_later(max(0.0, due - now) / 1000.0, self._flush, group)

    def _flush(self, group: Group) -> None:
        group.timer = None
        if group.inflight is None:
            self._start(group, renew=False)
        if group.inflight is None:
            with contextlib.suppress(RuntimeError):  # the loop is closing
                self._arm(group, self.now())
