"""cache: exact-prompt answers from memory (L1) or Redis (L2), in whichever form the client asked for.

- Key: `sluice:cache:v3:{<tenant>}:<model>:<sha256>`, the sha256 of the canonical JSON (sorted keys) of tenant,
  public model, endpoint and every request field except the transport-only ones (`stream`, `stream_options`, `user`,
  `metadata`, `store`, `prompt_cache_key`, `safety_identifier`). Field order and whitespace do not matter; unknown
  fields (vLLM's sampling extras) do. Tenants never share an entry unless the model is configured `cache: {shared:
  true}` (tenant `*` in the key). Tenant and model are in the key in clear (percent-encoded where they hold anything
  but letters, digits and `-_.`), so that `sluice cache purge --tenant T` is a scan of one prefix that can never
  match another tenant's keys; the tenant is the hash tag, so that a tenant's entries share a Redis Cluster slot.
  `key()` is the only place that builds a key; `layout` the only place that knows its parts
  (plugins/cache/layout.py).
- Policy per model: `deterministic` (the default: only temperature 0 or a seed), `always`, `off`.
  `Cache-Control: no-cache` skips the lookup but stores the answer; `no-store` does neither.
- Only complete successes are stored: a 200 whose stream reached its finish reason and `[DONE]`. The stored
  form is the answer's JSON bytes (a whole body as the upstream sent it, a stream assembled once), made
  after the response has ended; it replays as JSON or as SSE. Redis holds a one-line header and those
  bytes, written by one background writer in pipelined batches, each ending with a PUBLISH of its keys; a miss
  costs one GET on the request path, or none with `presence: true` when no gateway announced the key
  (plugins/cache/presence.py: a Bloom filter believed only while its subscription has had no gap since a SCAN).
- L1 is bounded by `l1_entries` and by `l1_bytes`, counting each entry's bytes, the SSE replays made of it
  and a fixed overhead for its key and bookkeeping. For the Responses API only a response whose
  status is `completed` is stored; background requests and reads of stored responses are never cached;
  `store` is part of a Responses key (it decides whether the id can be retrieved later), and so is
  `previous_response_id`, like every other field.
- Single flight: identical requests that arrive while the first is running share its upstream call.
  Streaming followers get the leader's bytes as they arrive; if the leader fails before its first byte, one
  follower takes over; after it, followers get the same error event. Bounded: `max_followers`,
  `follower_wait_s`.
- Redis down or slow: the shared Store's breaker skips L2 within milliseconds; L1 keeps serving.
- Stale answers: an entry outlives its TTL by `stale_s`; it is never served as a hit then, but when every
  target has failed (`on_failure`) it answers instead of the error, marked `x-sluice-cache: stale`.
"""

from __future__ import annotations

from plugins.cache import layout
from plugins.cache.exact import ENTRY_OVERHEAD, Cache, Entry

__all__ = ["ENTRY_OVERHEAD", "Cache", "Entry", "layout"]
