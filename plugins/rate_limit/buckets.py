"""The buckets a request is checked against, the in-process buckets, and OpenAI's headers and 429 for a verdict.

A verdict is a list of integers, the same whoever made it (the in-process buckets or this process's leases):
`[admitted, then per bucket of the plan: remaining (whole units, may be negative after a correction),
ms until full, ms to wait before this request's cost fits]`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.errors import RateLimitError

PERIOD_MS = 60_000  # the limits are per minute
REQUESTS = "requests"
TOKENS = "tokens"
ABBREVIATION = {REQUESTS: "RPM", TOKENS: "TPM"}
HEADERS: dict[str, tuple[bytes, bytes, bytes]] = {
    kind: (
        b"x-ratelimit-limit-" + kind.encode(),
        b"x-ratelimit-remaining-" + kind.encode(),
        b"x-ratelimit-reset-" + kind.encode(),
    )
    for kind in (REQUESTS, TOKENS)
}
RESETS: dict[int, bytes] = {}  # reset_value's, by ms
MAX_RESETS = 8192


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
    template: tuple[int, ...] = ()  # the in-process check's arguments, token costs left at 0
    # Per kind that has buckets: its three header names and the indices of its buckets.
    headers: tuple[tuple[tuple[bytes, bytes, bytes], tuple[int, ...]], ...] = ()
    # When each kind has one bucket (the usual plan): per kind, the limit header whole, the other two names
    # and where the bucket's remaining units are in a verdict; None when a kind has a tenant and a model bucket.
    single: tuple[tuple[tuple[bytes, bytes], bytes, bytes, int], ...] | None = None

    @classmethod
    def of(cls, buckets: tuple[Bucket, ...]) -> Plan:
        template = [0]
        for bucket in buckets:
            template += (bucket.limit, PERIOD_MS, 1 if bucket.kind == REQUESTS else 0)
        requests = tuple(i for i, b in enumerate(buckets) if b.kind == REQUESTS)
        tokens = tuple(i for i, b in enumerate(buckets) if b.kind == TOKENS)
        kinds = tuple((HEADERS[kind], found) for kind, found in ((REQUESTS, requests), (TOKENS, tokens)) if found)
        single = None
        if all(len(found) == 1 for _, found in kinds):
            single = tuple(
                ((limit, buckets[i].limit_header), remaining, reset, 3 * i + 1)
                for (limit, remaining, reset), (i,) in kinds
            )
        return cls(
            buckets,
            keys=tuple(b.key for b in buckets),
            requests=requests,
            tokens=tokens,
            token_keys=tuple(buckets[i].key for i in tokens),
            template=tuple(template),
            headers=kinds,
            single=single,
        )

    def costs(self, reserved: int) -> list[int]:
        """What admission takes from each bucket: 1 request; the reservation, at most the whole bucket.

        A reservation larger than the whole bucket waits for a full bucket instead of never fitting; the
        correction charges the rest, so one big request cannot lock a tenant out for good.
        """
        return [1 if b.kind == REQUESTS else min(reserved, b.limit) for b in self.buckets]

    def check_args(self, reserved: int) -> list[int]:
        args = list(self.template)
        for i in self.tokens:
            args[3 * i + 3] = min(reserved, self.buckets[i].limit)
        return args

    def correction_args(self, reserved: int, actual: int) -> list[int] | None:
        """Arguments that move each tokens bucket from what was charged to `actual`; None when nothing moves."""
        args = [1]
        moved = False
        for i in self.tokens:
            limit = self.buckets[i].limit
            delta = actual - min(reserved, limit)
            moved = moved or delta != 0
            args += (limit, PERIOD_MS, delta)
        return args if moved else None


@dataclass(slots=True)
class LocalBuckets:
    """Token buckets in this process: used without Redis and while it is down. Limits are then per process.

    The state of a bucket is the time at which it will be full again (`full_at`): its level is
    `limit - (full_at - now) * rate`, taking `c` moves `full_at` forward by `c / rate`, and a request fits
    while `full_at - now` stays within the period. A missing entry is a full bucket.
    """

    clock: Callable[[], float] = time.monotonic  # seconds; injectable for tests
    full_at: dict[str, float] = field(default_factory=dict)  # key -> clock ms when full again; absent: full

    def take(self, keys: Sequence[str], args: Sequence[int]) -> list[int]:
        """Check and charge every bucket, all or nothing. args: force ("1": corrections, which may be
        negative), then per bucket: limit, period (ms), cost. Returns a verdict."""
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


def reset_value(ms: int) -> bytes:
    """An x-ratelimit-reset-* value, made once per duration: the same few thousand recur at any steady rate."""
    value = RESETS.get(ms)
    if value is None:
        value = go_duration(ms).encode()
        if len(RESETS) < MAX_RESETS:
            RESETS[ms] = value
    return value


def ratelimit_headers(plan: Plan, verdict: list[int]) -> list[tuple[bytes, bytes]]:
    """OpenAI's x-ratelimit-* headers; with a tenant and a model bucket of a kind, the one with less left."""
    headers: list[tuple[bytes, bytes]] = []
    single = plan.single
    if single is not None:  # the request path's: the limit header made once, the other two values cached
        for limit_header, remaining, reset, at in single:
            left = verdict[at]
            ms = verdict[at + 1]
            headers += (
                limit_header,
                (remaining, b"%d" % left if left > 0 else b"0"),
                (reset, RESETS.get(ms) or reset_value(ms)),
            )
        return headers
    for (limit, remaining, reset), indices in plan.headers:
        i = indices[0]
        for j in indices[1:]:
            if verdict[3 * j + 1] < verdict[3 * i + 1]:
                i = j
        left = verdict[3 * i + 1]
        headers += (
            (limit, plan.buckets[i].limit_header),
            (remaining, str(left).encode() if left > 0 else b"0"),
            (reset, reset_value(verdict[3 * i + 2])),
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
