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
comes back smoothly instead of at window edges, and "time until the bucket is full again" is exactly what
OpenAI's `x-ratelimit-reset-*` headers report.

With Redis (`redis.url`) the buckets live there, shared by every worker and instance, but admission does not
ask Redis: each process holds leases, units taken from the shared buckets in batches by one script call per
tenant (`sync.py`), and admits from them in microseconds; corrections go back with the next sync
(`lease.py`). Without Redis, or while it is down, the same buckets run in this process (`buckets.py`), so
limits are then per process. The limiter never fails a request because its store is down.
"""

from __future__ import annotations

from plugins.rate_limit.buckets import PERIOD_MS, LocalBuckets, go_duration
from plugins.rate_limit.lease import Lease
from plugins.rate_limit.limiter import INFLIGHT, RateLimit, actual_tokens, build_plans, estimate
from plugins.rate_limit.sync import SCRIPT, Leases

__all__ = [
    "INFLIGHT",
    "PERIOD_MS",
    "SCRIPT",
    "Lease",
    "Leases",
    "LocalBuckets",
    "RateLimit",
    "actual_tokens",
    "build_plans",
    "estimate",
    "go_duration",
]
