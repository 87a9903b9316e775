"""One process's lease on one shared bucket: units taken from Redis in batches, admitted here in microseconds.

The arithmetic only (no I/O, times in ms of the process's monotonic clock, units are whole requests or
tokens); `sync.py` sends what a lease asks for and hands it back what Redis granted.

- `free`: units granted to this process and not yet admitted. Admission takes from it.
- `settle`: units to charge (+) or give back (-) at the next sync: token corrections from real usage,
  units admitted on credit while a sync was late, and free units given back when the lease lapses.
- The lease is sized to what the process admits in the next `HORIZON_MS` at its observed rate, at least
  what a waiting request needs, and otherwise at most `cap` (a share of the limit), so that a small limit
  is not all held by one process.
- Free units lapse `ttl_ms` after the last grant: they go back to the shared bucket, so an idle process
  does not hoard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from plugins.rate_limit.buckets import PERIOD_MS

HORIZON_MS = 200.0  # a lease is about what this process admits in this long
RATE_MEMORY_MS = 1000.0  # a falling rate is forgotten over about this long; a rising one is taken at once


@dataclass(slots=True)
class Lease:
    limit: int
    cap: int  # most units held at once, unless a waiting request needs more
    ttl_ms: float
    per_ms: float = field(init=False)  # the shared bucket's refill, units per ms
    free: int = 0
    settle: int = 0
    need: int = 0  # units a waiting request lacks: the next sync takes at least this many, or none
    expires: float = 0.0  # free units lapse then
    level: float = 0.0  # the shared bucket's level (this lease's free units excluded) at the last sync
    level_at: float = -math.inf  # when; never synced: the bucket is taken as full, as a missing key is
    held_until: float = -math.inf  # a failed sync keeps `level` the basis of decisions until then (`failed`)
    low: int = 0  # renew in the background once free falls below this; 0: never (too slow a rate to hold)
    used: int = 0  # units admitted since the last sync was sent, for the rate
    hits: int = 0  # requests admitted since then
    sent_at: float = -math.inf
    rate: float = 0.0  # units per ms, observed
    hit_rate: float = 0.0  # requests per ms, observed

    def __post_init__(self) -> None:
        self.per_ms = self.limit / PERIOD_MS
        self.level = float(self.limit)

    def take(self, cost: int) -> None:
        self.free -= cost
        self.used += cost
        self.hits += 1

    def owe(self, cost: int) -> None:
        """Admitted beyond the lease (a late sync): charged to the shared bucket at the next sync."""
        self.settle += cost
        self.used += cost
        self.hits += 1

    def known(self, now: float) -> float:
        """The shared bucket as this process knows it: its level at the last sync and the refill since, plus
        this lease's free units, minus what this process owes it."""
        level = min(float(self.limit), self.level + (now - self.level_at) * self.per_ms)
        return level + self.free - self.settle

    def fresh(self, now: float) -> bool:
        """Whether `known` is recent enough to decide on without asking Redis: for `ttl_ms` after the last
        sync, and, when a sync failed within that time, until the store is tried again (`held_until`)."""
        return now - self.level_at < self.ttl_ms or now < self.held_until

    def remaining(self, now: float) -> int:
        return self.report(now)[0]

    def full_in(self, remaining: int) -> int:
        """ms until the bucket is full again from `remaining`."""
        return max(0, math.ceil((self.limit - remaining) / self.per_ms))

    def report(self, now: float) -> tuple[int, int, int]:
        """A verdict's part for an admission: (remaining, full_in(remaining), 0 ms to wait), in one call, with
        `known` and `full_in` written out (the request path's; a call is about 650 instructions)."""
        limit = self.limit
        level = self.level + (now - self.level_at) * self.per_ms
        known = (limit if level > limit else level) + self.free - self.settle
        remaining = limit if known >= limit else math.floor(known)
        full = math.ceil((limit - remaining) / self.per_ms)
        return remaining, full if full > 0 else 0, 0

    def wait(self, now: float, cost: int) -> int:
        """ms until `cost` fits in what this process knows of the shared bucket."""
        return max(0, math.ceil((cost - self.known(now)) / self.per_ms))

    def target(self) -> int:
        return max(1, min(self.cap, round(self.rate * HORIZON_MS)))

    def outgoing(self, now: float, renew: bool) -> tuple[int, int, int] | None:
        """(settle, want, need) for the next sync, or None when this lease has nothing to say.

        `want`: units to take if the shared bucket has them (a top-up to the target); `need`: the fewest
        worth taking (a waiting request's), below which Redis grants nothing. `renew` is False for the
        sync that gives back lapsed leases: that one takes nothing new unless a request is waiting.
        """
        self._observe(now)
        if self.free and now >= self.expires:
            self.settle -= self.free
            self.free = 0
        need, self.need = self.need, 0
        want = 0
        # A sync for one lease tops up the tenant's others that are past a quarter of theirs: the buckets of
        # a request drain together, and syncing them together halves the calls.
        if need > 0 or (renew and self.low and self.free <= self.target() * 3 // 4):
            want = max(self.target() - self.free, need)
        if not want and not self.settle:
            return None
        settle, self.settle = self.settle, 0
        return settle, want, need

    def granted(self, now: float, grant: int, full_ms: int) -> None:
        """Redis's answer: `grant` units are this process's, and the shared bucket is full in `full_ms`."""
        self.free += grant
        self.level = self.limit - full_ms * self.per_ms
        self.level_at = now
        if grant:
            self.expires = now + self.ttl_ms
        # Renew before running dry only when more requests are expected before the lease would lapse;
        # a slow process takes what each request needs when it comes, and holds nothing in between.
        self.low = max(1, self.target() // 2) if self.hit_rate * self.ttl_ms >= 2 else 0

    def failed(self, now: float, retry_ms: float) -> None:
        """A sync failed (Redis down or stalled). What this lease knows stays: the shared bucket's level at the
        last sync (with the refill since), the units granted and not yet admitted (paid for in Redis) and what
        is owed (charged by the next sync that succeeds). Knowledge that was fresh at the failure stays the
        basis of decisions until the store is tried again, `retry_ms` from now: nothing newer can be learnt
        before then, and dropping it would admit on in-process buckets that were never charged while Redis
        was up. Knowledge already stale is not extended: then the in-process buckets decide."""
        self.need = self.low = 0
        if now - self.level_at < self.ttl_ms:
            self.held_until = max(self.held_until, now + retry_ms)

    def _observe(self, now: float) -> None:
        elapsed = max(now - self.sent_at, 1.0)
        decay = math.exp(-elapsed / RATE_MEMORY_MS)
        self.rate = max(self.used / elapsed, self.rate * decay)
        self.hit_rate = max(self.hits / elapsed, self.hit_rate * decay)
        self.used = self.hits = 0
        self.sent_at = now
