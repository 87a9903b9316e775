"""cache: exact-prompt answers from memory (L1) or Redis (L2), in whichever form the client asked for.

- Key: sha256 of the canonical JSON (sorted keys) of tenant, public model, endpoint and every request
  field except the transport-only ones (`stream`, `stream_options`, `user`, `metadata`, `store`). Field
  order and whitespace do not matter; unknown fields (vLLM's sampling extras) do. Tenants never share an
  entry unless the model is configured `cache: {shared: true}`.
- Policy per model: `deterministic` (the default: only temperature 0 or a seed), `always`, `off`.
  `Cache-Control: no-cache` skips the lookup but stores the answer; `no-store` does neither.
- Only complete successes are stored: a 200 whose stream reached its finish reason and `[DONE]` (for the
  Responses API: a response whose status is `completed`). The stored form is the assembled answer, written
  after the response has ended; it replays as JSON or as SSE. Background requests and reads of stored
  responses are never cached; `store` is part of a Responses key (it decides whether the id can be
  retrieved later), and so is `previous_response_id`, like every other field.
- Single flight: identical requests that arrive while the first is running share its upstream call.
  Streaming followers get the leader's bytes as they arrive; if the leader fails before its first byte, one
  follower takes over; after it, followers get the same error event. Bounded: `max_followers`,
  `follower_wait_s`.
- Redis down or slow: the shared Store's breaker skips L2 within milliseconds; L1 keeps serving.
- Stale answers: an entry outlives its TTL by `stale_s`; it is never served as a hit then, but when every
  target has failed (`on_failure`) it answers instead of the error, marked `x-sluice-cache: stale`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import orjson
from cachetools import TLRUCache
from pydantic import Field

from gateway import completion
from gateway.errors import UpstreamError
from gateway.plugin import Configured, Empty, Reply, Schema, Tap
from gateway.settings import Strict
from gateway.store import Store, StoreUnavailable

if TYPE_CHECKING:
    from gateway.context import Exchange
    from gateway.plugin import Outcome, ResponseHead
    from gateway.runtime import Runtime
    from gateway.settings import Settings

log = logging.getLogger("sluice.cache")

KEY_PREFIX = "sluice:cache:v1:"
TRANSPORT_ONLY = frozenset({"stream", "stream_options", "user", "metadata", "store"})
# For the Responses API `store` decides whether the answer's id can be retrieved and continued later.
RESPONSES_TRANSPORT_ONLY = TRANSPORT_ONLY - {"store"}
JSON_TYPE = (b"content-type", b"application/json")
SSE_TYPE = (b"content-type", b"text/event-stream")
HIT, MISS, BYPASS, STALE = b"hit", b"miss", b"bypass", b"stale"
LABEL = "cache"  # the metric label (and span attribute sluice.cache) this plugin reports: hit|miss|bypass|stale

CacheMode = Literal["deterministic", "always", "off"]


class CacheSection(Strict):
    """`cache:`"""

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


class CacheModel(Strict):
    """Its key under `models.NAME`."""

    cache: ModelCache = ModelCache()


Config = Configured[CacheSection, CacheModel, Empty]


@dataclass(frozen=True, slots=True)
class Policy:
    always: bool
    ttl_s: float
    shared: bool


@dataclass(slots=True)
class Entry:
    endpoint: str
    served: str  # the model that produced the answer
    answer: dict[str, Any]
    json: bytes  # the answer serialised once, for JSON replays
    size: int
    fresh_until: float  # wall-clock seconds: a hit until then, only a stale rescue after
    expires: float  # wall-clock seconds: gone after
    streams: dict[bool, bytes] = field(default_factory=dict)  # SSE replays made so far, by include_usage

    @property
    def fresh(self) -> bool:
        return time.time() < self.fresh_until

    def sse(self, include_usage: bool) -> bytes:
        """The answer as a stream, made on the first streamed hit and reused by the next ones."""
        body = self.streams.get(include_usage)
        if body is None:
            body = self.streams[include_usage] = completion.replay(self.endpoint, self.answer, include_usage)
        return body


@dataclass(slots=True)
class Lead:
    """ex.state["cache"] of the request that goes upstream and fills the entry."""

    key: str
    policy: Policy
    flight: Flight | None
    store: bool


class Flight:
    """One upstream call in progress that identical requests may follow."""

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.chunks: list[bytes] = []
        self.followers = 0
        self.done = False  # the leader's answer ended, well or badly
        self.entry: Entry | None = None  # set when it ended well and was stored
        self.failed = False
        self._changed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def feed(self, chunk: bytes) -> None:
        if chunk:
            self.chunks.append(chunk)
            self._wake()

    def finish(self, entry: Entry | None, failed: bool) -> None:
        self.done, self.entry, self.failed = True, entry, failed
        self._wake()

    def _wake(self) -> None:
        changed = self._changed
        if not changed.done():
            self._changed = asyncio.get_running_loop().create_future()
            changed.set_result(None)

    async def changed(self, timeout: float) -> bool:
        """Wait for the next chunk or the end; False on timeout."""
        try:
            await asyncio.wait_for(asyncio.shield(self._changed), timeout)
        except TimeoutError:
            return False
        return True

    async def follow(self) -> AsyncIterator[bytes]:
        """The leader's stream from its start, then live; an error event if it breaks off."""
        sent = 0
        while True:
            while sent < len(self.chunks):
                yield self.chunks[sent]
                sent += 1
            if self.done:
                if self.failed:
                    yield UpstreamError("the shared upstream answer broke off").sse_event()
                return
            await asyncio.shield(self._changed)


class Cache:
    name: ClassVar[str] = "cache"
    # After auth: entries are per tenant. Reports the lookup's result as a metric label.
    schema: ClassVar[Schema] = Schema(section=CacheSection, model=CacheModel, after=("auth",), labels={LABEL: "none"})

    def __init__(self, config: Config, settings: Settings) -> None:
        self.settings = base = config.section
        self.policies: dict[str, Policy | None] = {}
        for model, spec in config.models.items():
            mode = spec.cache.mode or base.mode
            self.policies[model] = (
                None
                if mode == "off"
                else Policy(always=mode == "always", ttl_s=spec.cache.ttl_s or base.ttl_s, shared=spec.cache.shared)
            )
        self.stale_s = base.stale_s
        self.l1: TLRUCache[str, Entry] = TLRUCache(
            maxsize=max(base.l1_bytes, 1),
            ttu=lambda _key, entry, _now: entry.expires,
            timer=time.time,
            getsizeof=lambda entry: entry.size,
        )
        self.flights: dict[str, Flight] = {}
        self.store: Store | None = None
        self.stats = {"hit_l1": 0, "hit_l2": 0, "miss": 0, "bypass": 0, "stored": 0, "followed": 0}
        self._writes: set[asyncio.Task[None]] = set()
        self.results: Any = None  # sluice_cache_results_total, made at start-up
        self.tenant_label: Callable[[str], str] = str

    async def startup(self, runtime: Runtime) -> None:
        self.store = runtime.store
        self.tenant_label = runtime.meter.tenant
        self.results = runtime.meter.counter(
            "sluice_cache_results_total",
            "Cache lookups by result (hit, miss, bypass, stale).",
            ("tenant", "model", "result"),
        )

    async def shutdown(self) -> None:
        for task in list(self._writes):
            with contextlib.suppress(Exception):
                await task

    # on_request: look up, follow, or lead

    async def on_request(self, ex: Exchange) -> Reply | None:
        policy = self.policies.get(ex.model)
        control = ex.header(b"cache-control") or b""
        if policy is None or b"no-store" in control or not (policy.always or _deterministic(ex)):
            self._bypass(ex)
            return None
        key = self.key(ex, policy)
        if b"no-cache" not in control:
            entry = self.l1.get(key)
            if entry is None:
                entry = await self._l2_get(key)
            elif entry.fresh:
                self.stats["hit_l1"] += 1
            if entry is not None and entry.fresh:
                _mark(ex, HIT)
                return self._replay(ex, entry)
        while True:
            flight = self.flights.get(key)
            if flight is None or flight.followers >= self.settings.max_followers:
                break
            reply = await self._follow(ex, flight)
            if reply is not None:
                return reply
            if self.flights.get(key) is flight:  # the leader is still running: we waited long enough
                ex.state["cache"] = Lead(key, policy, None, store=False)
                ex.labels[LABEL] = "miss"
                self.stats["miss"] += 1
                return None
        flight = None if key in self.flights else Flight(ex.stream)
        if flight is not None:
            self.flights[key] = flight
        ex.state["cache"] = Lead(key, policy, flight, store=True)
        ex.labels[LABEL] = "miss"
        self.stats["miss"] += 1
        return None

    def _bypass(self, ex: Exchange) -> None:
        _mark(ex, BYPASS)
        self.stats["bypass"] += 1

    def key(self, ex: Exchange, policy: Policy) -> str:
        skip = RESPONSES_TRANSPORT_ONLY if ex.endpoint == "responses" else TRANSPORT_ONLY
        fields = {k: v for k, v in ex.json.items() if k not in skip}
        scope = "*" if policy.shared else ex.tenant
        material = orjson.dumps([scope, ex.model, ex.endpoint, fields], option=orjson.OPT_SORT_KEYS)
        return KEY_PREFIX + hashlib.sha256(material).hexdigest()

    async def _follow(self, ex: Exchange, flight: Flight) -> Reply | None:
        """Share `flight`'s answer; None when the leader failed before answering (then lead ourselves)."""
        flight.followers += 1
        try:
            wait = self.settings.follower_wait_s
            while not flight.chunks and not flight.done:
                if not await flight.changed(wait):
                    return None
            if flight.stream and ex.stream and flight.chunks and not (flight.done and flight.failed):
                _mark(ex, HIT)
                self.stats["followed"] += 1
                return Reply(headers=[SSE_TYPE], stream=flight.follow(), source="cache")
            while not flight.done:
                if not await flight.changed(wait):
                    return None
            if flight.entry is None:
                return None
            _mark(ex, HIT)
            self.stats["followed"] += 1
            return self._replay(ex, flight.entry)
        finally:
            flight.followers -= 1

    def _replay(self, ex: Exchange, entry: Entry) -> Reply:
        headers = [(b"x-sluice-model", entry.served.encode())]
        if ex.stream:
            options = ex.json.get("stream_options")
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            return Reply(headers=[SSE_TYPE, *headers], body=entry.sse(include_usage), source="cache")
        return Reply(headers=[JSON_TYPE, *headers], body=entry.json, source="cache")

    async def _l2_get(self, key: str) -> Entry | None:
        if self.store is None:
            return None
        try:
            raw = await self.store.execute("GET", key)
        except StoreUnavailable:
            return None
        if raw is None:
            return None
        try:
            stored = orjson.loads(raw)
            entry = _entry(stored["endpoint"], stored["served"], stored["answer"], stored["fresh_until"], self.stale_s)
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return None
        if entry.fresh:
            self.stats["hit_l2"] += 1
        self.l1[key] = entry
        return entry

    async def on_failure(self, ex: Exchange, error: Exception) -> Reply | None:
        """Every target failed: an entry past its TTL is better than an error."""
        state = ex.state.get("cache")
        if not isinstance(state, Lead):
            return None
        entry = self.l1.get(state.key) or await self._l2_get(state.key)
        if entry is None:
            return None
        log.info("serving a stale answer for %s: %s", ex.model, error)
        _mark(ex, STALE)
        return self._replay(ex, entry)

    # on_response / on_complete: collect what the leader got, store it if it is whole

    async def on_response(self, ex: Exchange, head: ResponseHead) -> Tap | None:
        state = ex.state.get("cache", BYPASS)
        if isinstance(state, Lead):
            head.headers.append((b"x-sluice-cache", MISS))
            if head.status == 200 and (state.store or state.flight is not None):
                if state.flight is None:
                    state.flight = Flight(ex.stream)  # a private collector: nobody follows it
                return state.flight.feed
            return None
        head.headers.append((b"x-sluice-cache", state))
        return None

    async def on_complete(self, ex: Exchange, outcome: Outcome) -> None:
        result = ex.labels.get(LABEL)
        if result is not None and self.results is not None:
            self.results.labels(self.tenant_label(ex.tenant), ex.model, result).inc()
        state = ex.state.get("cache")
        if not isinstance(state, Lead):
            return
        entry = None
        flight = state.flight
        whole = outcome.complete and outcome.status == 200 and outcome.source == "upstream"
        if flight is not None and whole:
            entry = self._assemble(ex, flight.chunks, state.policy.ttl_s)
        if flight is not None and self.flights.get(state.key) is flight:
            del self.flights[state.key]
        if flight is not None:
            flight.finish(entry, failed=not whole)
        if entry is not None and state.store:
            self._store(state.key, entry)

    def _assemble(self, ex: Exchange, chunks: list[bytes], ttl_s: float) -> Entry | None:
        body = b"".join(chunks)
        if len(body) > self.settings.max_entry_bytes * 4:
            return None
        try:
            answer = completion.assemble(ex.endpoint, body) if ex.stream else orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(answer, dict) or answer.get("error"):  # a response object's "error" is null
            return None
        if ex.endpoint == "responses":
            if answer.get("status") != "completed":
                return None
        elif ex.endpoint != "embeddings" and not all(c.get("finish_reason") for c in answer.get("choices") or [{}]):
            return None
        served = ex.served.model if ex.served is not None else ex.model
        entry = _entry(ex.endpoint, served, answer, time.time() + ttl_s, self.stale_s)
        return entry if entry.size <= self.settings.max_entry_bytes else None

    def _store(self, key: str, entry: Entry) -> None:
        if len(self.l1) >= self.settings.l1_entries > 0:
            self.l1.popitem()
        if self.settings.l1_entries > 0:
            self.l1[key] = entry
        self.stats["stored"] += 1
        if self.store is not None:
            record = orjson.dumps(
                {
                    "endpoint": entry.endpoint,
                    "served": entry.served,
                    "answer": entry.answer,
                    "fresh_until": entry.fresh_until,
                }
            )
            ttl_s = max(entry.expires - time.time(), 0.001)
            task = asyncio.get_running_loop().create_task(self._l2_set(key, record, ttl_s))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    async def _l2_set(self, key: str, record: bytes, ttl_s: float) -> None:
        assert self.store is not None
        with contextlib.suppress(StoreUnavailable):
            await self.store.execute("SET", key, record, "PX", int(ttl_s * 1000))


def _mark(ex: Exchange, result: bytes) -> None:
    ex.state["cache"] = result
    ex.labels[LABEL] = result.decode()


def _entry(endpoint: str, served: str, answer: dict[str, Any], fresh_until: float, stale_s: float) -> Entry:
    data = orjson.dumps(answer)
    return Entry(endpoint, served, answer, data, len(data) + 256, fresh_until, fresh_until + stale_s)


def _deterministic(ex: Exchange) -> bool:
    if ex.endpoint == "embeddings":
        return True
    body = ex.json
    if ex.resource or body.get("background"):
        return False  # a stored response changes (cancel, delete); a background one is polled, not replayed
    temperature = body.get("temperature")
    seed = body.get("seed")
    return temperature == 0 or (isinstance(seed, int) and not isinstance(seed, bool))
