"""The exact cache: the plugin's hooks, its key, L1 and L2 lookups, the miss path's record and writes.

The package's docstring says how it works. Apart from `__init__` so that it can be compiled (mypyc runs a
compiled package `__init__` before its `__path__` is set, so it could not import its interpreted submodules).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import orjson

from gateway.plugin import Configured, Empty, Reply, Schema, Tap
from gateway.state.store import Store, StoreUnavailable
from gateway.wire import completion
from plugins.cache import layout
from plugins.cache.config import CacheModel, CacheSection
from plugins.cache.flight import Flight
from plugins.cache.l1 import L1
from plugins.cache.presence import CHANNEL, Presence, announcement
from plugins.cache.replay import follow

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from gateway.context import Exchange
    from gateway.plugin import Outcome, Problem, ResponseHead
    from gateway.runtime import Runtime
    from gateway.settings import Settings
    from gateway.telemetry.tally import Tally

log = logging.getLogger("sluice.cache")

# How the answer travels or whom it is for, not what it says: `prompt_cache_key` and `safety_identifier` name a
# conversation and a user for the provider (the Codex CLI sends a new key per conversation).
TRANSPORT_ONLY = frozenset(
    {"stream", "stream_options", "user", "metadata", "store", "prompt_cache_key", "safety_identifier"}
)
# For the Responses API `store` decides whether the answer's id can be retrieved and continued later.
RESPONSES_TRANSPORT_ONLY = TRANSPORT_ONLY - {"store"}
JSON_TYPE = (b"content-type", b"application/json")
SSE_TYPE = (b"content-type", b"text/event-stream")
HIT, MISS, BYPASS, STALE = b"hit", b"miss", b"bypass", b"stale"
# What an L1 entry costs beyond its bytes: the key (an 80-character str), the Entry and its bytes object,
# L1's two dict slots; measured with tracemalloc (see tests/unit/plugins/test_cache_memory.py), with room to spare.
ENTRY_OVERHEAD = 800
WRITE_BATCH = 64  # SETs per pipelined round trip
MAX_UNANNOUNCED = 4096  # keys of failed round trips announced again (beyond, the oldest: they may be skipped)
RETRY_S = 1.0  # between announcements tried alone while Redis fails
MAX_PENDING_WRITES = 4096  # beyond this (Redis slow), the oldest queued writes are dropped
LABEL = "cache"  # the metric label (and span attribute sluice.cache) this plugin reports: hit|miss|bypass|stale

Config = Configured[CacheSection, CacheModel, Empty]


@dataclass(frozen=True, slots=True)
class Policy:
    always: bool
    ttl_s: float
    shared: bool


class Entry:
    __slots__ = ("endpoint", "expires", "fresh_until", "json", "served", "size", "streams")

    def __init__(self, endpoint: str, served: str, json: bytes, fresh_until: float, expires: float) -> None:
        self.endpoint = endpoint
        self.served = served  # the model that produced the answer
        self.json = json  # the answer's JSON, as a JSON hit sends it; parsed only to make an SSE replay
        self.fresh_until = fresh_until  # wall-clock seconds: a hit until then, only a stale rescue after
        self.expires = expires  # wall-clock seconds: gone after
        self.streams: dict[bool, bytes] | None = None  # SSE replays made so far, by include_usage
        self.size = len(json) + ENTRY_OVERHEAD  # the memory it holds, as L1 accounts it

    @property
    def fresh(self) -> bool:
        return time.time() < self.fresh_until

    def sse(self, include_usage: bool) -> tuple[bytes, bool]:
        """The answer as a stream, made on the first streamed hit and reused by the next; True if made now."""
        streams = self.streams
        if streams is None:
            streams = self.streams = {}
        body = streams.get(include_usage)
        if body is not None:
            return body, False
        body = streams[include_usage] = completion.replay(self.endpoint, orjson.loads(self.json), include_usage)
        self.size += len(body)
        return body, True

    def record(self) -> bytes:
        """The Redis form: a one-line JSON header, then the answer's bytes as they are."""
        return orjson.dumps([self.endpoint, self.served, self.fresh_until]) + b"\n" + self.json

    @classmethod
    def parse(cls, record: bytes, stale_s: float) -> Entry | None:
        header, newline, answer = record.partition(b"\n")
        try:
            endpoint, served, fresh_until = orjson.loads(header)
        except (orjson.JSONDecodeError, TypeError, ValueError):
            return None
        if not newline or not isinstance(endpoint, str) or not isinstance(served, str):
            return None
        if not isinstance(fresh_until, int | float):
            return None
        return cls(endpoint, served, answer, fresh_until, fresh_until + stale_s)


@dataclass(slots=True, init=False)  # __init__ written out: compiled, a dataclass's own is interpreted
class Lead:
    """ex.state["cache"] of the request that goes upstream and fills the entry."""

    key: str
    policy: Policy
    flight: Flight | None
    store: bool

    def __init__(self, key: str, policy: Policy, flight: Flight | None, store: bool) -> None:
        self.key = key
        self.policy = policy
        self.flight = flight
        self.store = store


class Cache:
    name: ClassVar[str] = "cache"
    # After auth: entries are per tenant. Reports the lookup's result as a metric label.
    schema: ClassVar[Schema] = Schema(section=CacheSection, model=CacheModel, after=("auth",), labels={LABEL: "none"})

    @classmethod
    def check(cls, config: Config, settings: Settings, listed: Sequence[str]) -> Iterable[Problem]:
        if config.section.presence and not settings.redis.url:
            yield "cache.presence", "needs redis.url: it tells which keys Redis may hold"

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
        self.l1: L1[Entry] = L1(base.l1_entries, base.l1_bytes)
        self.prefixes: dict[tuple[str, str], str] = {}  # (scope, model) -> its key prefix, made once
        self.flights: dict[str, Flight] = {}
        self.store: Store | None = None
        self.stats = {"hit_l1": 0, "hit_l2": 0, "miss": 0, "bypass": 0, "stored": 0, "followed": 0}
        self._pending: list[tuple[str, str, bytes, str, int]] = []  # SETs not yet sent to Redis
        self._writer: asyncio.Task[None] | None = None
        self._unannounced: list[str] = []  # keys of round trips that failed: maybe stored, not known announced
        self._closing = False
        self._wake = asyncio.Event()  # a write queued while the writer waits to announce again
        self.results: Tally | None = None  # sluice_cache_results_total, made at start-up
        self.tenant_label: Callable[[str], str] = str
        # An entry lives in Redis until its TTL and stale_s have passed: the filter's generations are that long.
        self.fresh_s = max((p.ttl_s for p in self.policies.values() if p is not None), default=base.ttl_s)
        lifetime_s = self.fresh_s + self.stale_s
        self.presence: Presence | None = Presence(base.presence_keys, lifetime_s) if base.presence else None
        self._listener: asyncio.Task[None] | None = None

    async def startup(self, runtime: Runtime) -> None:
        self.store = runtime.store
        if self.store is None:
            self.presence = None
        elif self.presence is not None:
            synced = runtime.meter.gauge(
                "sluice_cache_presence_synced",
                "1 while the cache's presence filter is believed (misses skip Redis), 0 while every miss asks Redis.",
                (),
                mode="livemin",
            )
            synced.set(0.0)
            self.presence.shown = synced.set
            self.presence.start()
            listening = self.presence.listen(self.store, self.store.node_urls)
            self._listener = asyncio.get_running_loop().create_task(listening)
        self.tenant_label = runtime.meter.tenant
        self.results = runtime.meter.tally(
            "sluice_cache_results_total",
            "Cache lookups by result (hit, miss, bypass, stale).",
            ("tenant", "model", "result"),
        )

    async def shutdown(self) -> None:
        self._closing = True  # queued writes are still made; announcements retried alone are not
        self._wake.set()
        if self.presence is not None:
            self.presence.stop()
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
        if self._writer is not None:
            with contextlib.suppress(Exception):
                await self._writer

    # on_request: look up, follow, or lead

    async def on_request(self, ex: Exchange) -> Reply | None:
        policy = self.policies.get(ex.model)
        # `in` on bytes costs about 2k instructions in CPython 3.11 (the needle is first tried as an int, and
        # the TypeError formatted): the usual request has no Cache-Control to search, and find() tries no int.
        control = ex.header(b"cache-control")
        if (
            policy is None
            or (control is not None and control.find(b"no-store") >= 0)
            or not (policy.always or _deterministic(ex))
        ):
            self._bypass(ex)
            return None
        key = self.key(ex, policy)
        if control is None or control.find(b"no-cache") < 0:
            entry = self.l1.get(key)
            if entry is None:
                presence = self.presence
                if presence is None or presence.maybe(key):
                    entry = await self._l2_get(key)
            elif entry.fresh:
                self.stats["hit_l1"] += 1
            if entry is not None and entry.fresh:
                _mark(ex, HIT)
                return self._replay(ex, key, entry)
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
        # The loop ended on no flight or a full one: a full one keeps its place, and this request runs alone.
        if flight is None:
            flight = self.flights[key] = Flight(ex.stream)
        else:
            flight = None
        ex.state["cache"] = Lead(key, policy, flight, store=True)
        ex.labels[LABEL] = "miss"
        self.stats["miss"] += 1
        return None

    def _bypass(self, ex: Exchange) -> None:
        _mark(ex, BYPASS)
        self.stats["bypass"] += 1

    def key(self, ex: Exchange, policy: Policy) -> str:
        skip = RESPONSES_TRANSPORT_ONLY if ex.endpoint == "responses" else TRANSPORT_ONLY
        body = ex.json
        fields = body if skip.isdisjoint(body) else {k: v for k, v in body.items() if k not in skip}
        scope = layout.SHARED if policy.shared else ex.tenant
        material = orjson.dumps([scope, ex.model, ex.endpoint, fields], option=orjson.OPT_SORT_KEYS)
        prefix = self.prefixes.get((scope, ex.model))
        if prefix is None:
            prefix = self.prefixes[(scope, ex.model)] = layout.prefix(scope, ex.model)
        return prefix + hashlib.sha256(material).hexdigest()

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
                return Reply(headers=[SSE_TYPE], stream=follow(flight), source="cache")
            while not flight.done:
                if not await flight.changed(wait):
                    return None
            if flight.entry is None:
                return None
            _mark(ex, HIT)
            self.stats["followed"] += 1
            return self._replay(ex, None, flight.entry)
        finally:
            flight.followers -= 1

    def _replay(self, ex: Exchange, key: str | None, entry: Entry) -> Reply:
        headers = [(b"x-sluice-model", entry.served.encode())]
        if ex.stream:
            body, made = entry.sse(ex.include_usage)
            if made and key is not None and self.l1.entries.get(key) is entry:
                self.l1.put(key, entry)  # again, so that L1 counts the replay's bytes too
            return Reply(headers=[SSE_TYPE, *headers], body=body, source="cache")
        return Reply(headers=[JSON_TYPE, *headers], body=entry.json, source="cache")

    async def _l2_get(self, key: str) -> Entry | None:
        if self.store is None:
            return None
        try:
            raw = await self.store.execute("GET", key)
        except StoreUnavailable:
            return None
        if not isinstance(raw, bytes):
            return None
        entry = Entry.parse(raw, self.stale_s)
        if entry is None:
            return None
        if entry.fresh:
            self.stats["hit_l2"] += 1
        self._keep(key, entry)
        return entry

    def _keep(self, key: str, entry: Entry) -> None:
        self.l1.put(key, entry)

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
        return self._replay(ex, state.key, entry)

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

    def on_complete(self, ex: Exchange, outcome: Outcome) -> None:
        result = ex.labels.get(LABEL)
        if result is not None and self.results is not None:
            self.results.add((self.tenant_label(ex.tenant), ex.model, result))
        state = ex.state.get("cache")
        if not isinstance(state, Lead):
            return
        entry = None
        flight = state.flight
        whole = outcome.complete and outcome.status == 200 and outcome.source == "upstream"
        if flight is not None and whole:
            entry = self._assemble(ex, flight.chunks, state.policy.ttl_s, outcome)
        if flight is not None and self.flights.get(state.key) is flight:
            del self.flights[state.key]
        if flight is not None:
            flight.finish(entry, failed=not whole)
        if entry is not None and state.store:
            self._store(state.key, entry)

    def _assemble(self, ex: Exchange, chunks: list[bytes], ttl_s: float, outcome: Outcome) -> Entry | None:
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if len(body) > self.settings.max_entry_bytes * 4:
            return None
        if ex.stream:
            usage = outcome.usage if outcome.usage_source == "upstream" else None
            data = completion.finished(ex.endpoint, body, usage)
        elif ex.endpoint == "responses":
            data = body if _completed_response(body) else None
        else:
            # A whole body is kept as the upstream sent it: no parse, no re-serialisation. A 200 that is
            # not a finished answer shows in its bytes (compact or spaced JSON alike).
            # (find(), not `in`: see on_request.)
            whole = (body[:1] == b"{" or body.lstrip()[:1] == b"{") and body.find(b'"error":') < 0
            unfinished = ex.endpoint != "embeddings" and (
                body.find(b'"finish_reason":null') >= 0 or body.find(b'"finish_reason": null') >= 0
            )
            data = body if whole and not unfinished else None
        if data is None or len(data) > self.settings.max_entry_bytes:
            return None
        served = ex.served.model if ex.served is not None else ex.model
        fresh_until = time.time() + ttl_s
        return Entry(ex.endpoint, served, data, fresh_until, fresh_until + self.stale_s)

    def _store(self, key: str, entry: Entry) -> None:
        self._keep(key, entry)
        self.stats["stored"] += 1
        if self.store is None:
            return
        ttl_ms = max(int((entry.expires - time.time()) * 1000), 1)
        pending = self._pending
        pending.append(("SET", key, entry.record(), "PX", ttl_ms))
        if len(pending) > MAX_PENDING_WRITES:
            del pending[: len(pending) - MAX_PENDING_WRITES]
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write())
        elif self._unannounced:
            self._wake.set()  # the writer is waiting to announce again: write now, as it would without that

    async def _write(self) -> None:
        """The one writer: what was queued by the time it runs goes in one pipelined round trip, and so on.

        Each round trip ends with the announcement of its keys (plugins/cache/presence.py), made by every
        gateway, so that one that reads announcements never misses a key another stored. A round trip that
        fails may still have stored some of its keys (on a cluster the SETs and the PUBLISH go to different
        nodes), so its keys are announced again with the next one, or alone a second later, until Redis
        takes an announcement."""
        store = self.store
        assert store is not None
        try:
            while self._pending or (self._unannounced and not self._closing):
                if not self._pending:
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), RETRY_S)
                    if self._pending or self._closing:
                        continue
                batch = self._pending[:WRITE_BATCH]
                del self._pending[:WRITE_BATCH]
                keys = [command[1] for command in batch]
                if self._unannounced:
                    keys += self._unannounced
                told = announcement(keys, self.fresh_s)
                try:
                    if batch:
                        replies = await store.pipeline([*batch, ("PUBLISH", CHANNEL, told)])
                    else:
                        replies = await store.pipeline([("PUBLISH", CHANNEL, told)], always=True)
                except StoreUnavailable:
                    self._pending.clear()  # Redis is down: L1 serves; entries come back on later misses
                    self._unannounced = keys[-MAX_UNANNOUNCED:]
                    continue
                if isinstance(replies[-1], Exception):  # refused (an ACL without PUBLISH): said, and tried again
                    if not self._unannounced:
                        log.warning("cache: Redis refused the announcement of stored keys (%s): gateways with "
                                    "cache.presence skip them until it is taken", replies[-1])  # fmt: skip
                    self._unannounced = keys[-MAX_UNANNOUNCED:]
                    continue
                self._unannounced = []
                if self.presence is not None:
                    self.presence.published(told)
        finally:
            self._writer = None


def _mark(ex: Exchange, result: bytes) -> None:
    ex.state["cache"] = result
    ex.labels[LABEL] = result.decode()


def _completed_response(body: bytes) -> bool:
    """A Responses object that finished (its own `error` is null, so the bytes alone cannot tell)."""
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(answer, dict) and answer.get("status") == "completed" and not answer.get("error")


def _deterministic(ex: Exchange) -> bool:
    if ex.endpoint == "embeddings":
        return True
    body = ex.json
    if ex.resource or body.get("background"):
        return False  # a stored response changes (cancel, delete); a background one is polled, not replayed
    temperature = body.get("temperature")
    seed = body.get("seed")
    return temperature == 0 or (isinstance(seed, int) and not isinstance(seed, bool))
