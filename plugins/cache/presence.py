"""Which cache keys Redis may hold, so that a lookup Redis cannot answer is not sent.

With every stage on, most of what a miss adds to the time to first token is its Redis GET: a round trip to
another process, two wake-ups. Every writer announces the keys it stores (`announcement`: how long its entries
stay fresh, then the last `DIGITS` hex digits of each key, published on `CHANNEL` at the end of the pipelined
round trip that carries the SETs, by every gateway with Redis whether or not it reads them), and a gateway with
`cache.presence` on keeps them in a Bloom filter: a key with no mention is not in Redis, and its GET is skipped.

- **Generations.** An entry lives in Redis at most `lifetime_s` (the longest TTL plus `stale_s`) and is served
  as a hit only while fresh (the TTL): stale ones are read only when every target failed, and that read never
  asks the filter. The filter is two generations of `lifetime_s`: additions go to the young one, and at each
  turn the old one is dropped and the young one becomes old, so a key is in one of the two for at least as
  long as its entry can live, and the filter forgets what expired instead of filling up. An announcement from a
  gateway whose entries stay fresh longer lengthens the generations (`lengthen`).
- **Trust (the cache's rule for shared state: fail open).** The filter is only believed while it is whole:
  subscribed without a gap since before a SCAN of the cache's keys ended (or for a whole lifetime, when no
  SCAN can be made). Until then, and from the moment the subscription is lost (a closed connection, a PING
  unanswered: Redis stopped, stalled or restarted empty; or deaf: an announcement of its own that Redis took
  not heard back within DEAF_S, as on a cluster node cut off from the others), `maybe` is True for every key:
  a fault costs round trips, never an answer. The filter only ever skips a lookup; it never serves one.
- **Writes that fail.** A round trip that fails may have stored some of its keys (on a cluster the SETs and
  the PUBLISH go to different nodes); its keys are announced again with the next round trip, or alone a
  second later, until Redis takes an announcement (plugins/cache/exact.py, `_write`).
- **What it can get wrong.** A false positive (about 1.5 % at the sized load) is a GET as before. A key
  stored by another gateway is skipped for the moment its announcement takes to arrive, or while a failed
  write waits to be announced again: a miss Redis could have answered, as when two gateways miss at once.
  Keys written into Redis by anything that does not announce them are not seen once the filter is trusted
  (`sluice cache prefill` goes through the pipeline and announces); keys a SCAN found are kept for this
  gateway's lifetime, so gateways that share a Redis should agree on the longest TTL. Messages on the channel
  in no format of ours are ignored and counted (the format is in the channel's name), so that nobody can
  force rescans by publishing junk.
- **Cost.** Each gateway reads every gateway's announcements (one message per write batch, its own included:
  a gateway learns its own keys from them too, its L1 answering meanwhile) and holds two arrays of 1.5 to 3
  bytes per key of `presence_keys` each (12 bits a key, rounded up to a power of two). A lookup is a slice of
  the key, an int, a mask and at most two array reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING

from gateway.state.store import StoreUnavailable
from gateway.state.subscriber import subscribe
from plugins.cache import layout

if TYPE_CHECKING:
    from gateway.state.store import Store

log = logging.getLogger("sluice.cache")

# The announcement's format is in the channel's name: a gateway that announced differently would be on another.
CHANNEL = "sluice:cache:v3:stored:1"
# 60 bits of a key's sha256 (a native int when compiled: below 2**62): the low 25 bits say which five bits of
# a 32-bit word to set (`mask_of`), the rest which word. One word per key (a blocked Bloom filter) is one array
# access and a mask, not seven scattered bit tests: about 1.5 % false positives at BITS_PER_KEY, against 0.8 %
# unblocked.
DIGITS = 15
BITS_PER_KEY = 12
RETRY_S = 1.0  # after a lost subscription or a failed SCAN
DEAF_S = 5.0  # a gateway that has not heard its own announcement by then is not hearing the channel


def announcement(keys: list[str], ttl_s: float) -> bytes:
    """What a writer publishes for `keys`: the longest time its entries are fresh (whole seconds), a colon,
    then the last DIGITS hex digits of each key, one after another."""
    return b"%d:%s" % (math.ceil(ttl_s), "".join([key[-DIGITS:] for key in keys]).encode())


def mask_of(value: int) -> int:
    return (
        1 << (value & 31)
        | 1 << ((value >> 5) & 31)
        | 1 << ((value >> 10) & 31)
        | 1 << ((value >> 15) & 31)
        | 1 << ((value >> 20) & 31)
    )


class Bloom:
    """A blocked Bloom filter of 60-bit values: five bits in one 32-bit word of a power-of-two array (`Presence.maybe`
    reads both generations with one mask)."""

    __slots__ = ("last", "words")

    def __init__(self, size_bits: int) -> None:
        self.words = array("I", bytes(size_bits >> 3))
        self.last = len(self.words) - 1  # a mask: the word count is a power of two

    def add(self, value: int) -> None:
        self.words[(value >> 25) & self.last] |= mask_of(value)

    def clear(self) -> None:
        self.words = array("I", bytes(len(self.words) * 4))


def size_for(keys: int) -> int:
    """Bits for `keys` keys at BITS_PER_KEY, rounded up to a power of two (at least 64 KiB of them)."""
    wanted = max(keys * BITS_PER_KEY, 1 << 16)
    return 1 << (wanted - 1).bit_length()


class Presence:
    def __init__(self, keys: int, lifetime_s: float) -> None:
        self.size = size_for(keys)
        self.lifetime_s = lifetime_s
        self.young = Bloom(self.size)
        self.old = Bloom(self.size)
        self.trusted = False
        self.shown: Callable[[float], None] | None = None  # the synced gauge's `set`, once metrics exist
        self.skipped = 0  # lookups not sent to Redis
        self.heard = 0  # keys announced (this gateway's own included)
        self.ignored = 0  # messages on the channel in no format of ours: ignored, the first one logged
        self.awaited: bytes | None = None  # an announcement of ours not yet heard back (see `published`)
        self.resyncs = 0  # subscriptions (re)established, each followed by a SCAN
        self.epoch = 0  # which subscription the running SCAN belongs to: a later one makes it moot
        self.store: Store | None = None  # set by listen
        self._turn: asyncio.TimerHandle | None = None
        self._sync: asyncio.Task[None] | None = None
        self._subscription: asyncio.Task[None] | None = None
        self._next_check = 0.0  # loop time before which `published` arms no new deafness check
        self._said = ""  # the last listener failure logged: one line when the reason changes, not one a second

    # the request path

    def maybe(self, key: str) -> bool:
        """False only when Redis cannot hold `key`; True while the filter is not whole."""
        if not self.trusted:
            return True
        try:
            value = int(key[-DIGITS:], 16)
        except ValueError:
            return True
        mask = mask_of(value)
        young, old = self.young, self.old
        if young.words[(value >> 25) & young.last] & mask == mask or old.words[(value >> 25) & old.last] & mask == mask:
            return True
        self.skipped += 1
        return False

    # announcements and the SCAN

    def hear(self, payload: bytes) -> None:
        if payload == self.awaited:
            self.awaited = None
        head, colon, digests = payload.partition(b":")
        try:
            if not colon or len(digests) % DIGITS:
                raise ValueError(len(digests))
            fresh_s = float(int(head))
            values = [int(digests[start : start + DIGITS], 16) for start in range(0, len(digests), DIGITS)]
        except ValueError:
            # Not from a gateway of this format (the format is in the channel's name): nothing it could say
            # would be ours, so it is ignored rather than taken as a gap (which anyone could then force).
            if not self.ignored:
                log.warning("cache: ignoring a message on %s in no format of ours: %r", CHANNEL, payload[:80])
            self.ignored += 1
            return
        if fresh_s > self.lifetime_s:
            self.lengthen(fresh_s)
        add = self.young.add
        for value in values:
            add(value)
        self.heard += len(values)

    def published(self, payload: bytes) -> None:
        """An announcement of ours that Redis took: it must come back within DEAF_S, or the subscription is
        deaf (a node cut off from the cluster bus hears none of the others' PUBLISH) and is taken as lost."""
        if self.awaited is not None or not self.trusted:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now < self._next_check:  # one check a DEAF_S is enough, however many batches are written
            return
        self._next_check = now + DEAF_S
        self.awaited = payload
        loop.call_later(DEAF_S, self._check_heard, payload)

    def _check_heard(self, payload: bytes) -> None:
        if self.awaited is payload:
            self.awaited = None
            if self.trusted:
                self._untrust(f"its own announcement was not heard within {DEAF_S:g} s")
                if self._subscription is not None:
                    self._subscription.cancel()  # the listener takes the next node

    def found(self, keys: list[bytes]) -> None:
        young = self.young
        for key in keys:
            with contextlib.suppress(ValueError):
                young.add(int(key[-DIGITS:], 16))

    def _untrust(self, why: str) -> None:
        """Announcements may have been missed: believe nothing until the next subscription has been synced."""
        if self.trusted:
            log.warning("cache presence filter not trusted (%s): every miss asks Redis until it is synced", why)
        self._trust(False)
        self.epoch += 1

    def _trust(self, trusted: bool) -> None:
        self.trusted = trusted
        if self.shown is not None:
            self.shown(1.0 if trusted else 0.0)

    # the generations

    def start(self) -> None:
        self._turn = asyncio.get_running_loop().call_later(self.lifetime_s, self.rotate)

    def lengthen(self, lifetime_s: float) -> None:
        """Another gateway's entries stay fresh longer than ours: keep every key that long from now on (the
        generation under way turns on its old schedule, the next ones on the new)."""
        log.info("cache presence: generations lengthened to %g s, as another gateway's entries last", lifetime_s)
        self.lifetime_s = lifetime_s

    def rotate(self) -> None:
        old = self.old
        old.clear()
        self.old, self.young = self.young, old
        self._turn = asyncio.get_running_loop().call_later(self.lifetime_s, self.rotate)

    def stop(self) -> None:
        if self._turn is not None:
            self._turn.cancel()
        if self._subscription is not None:
            self._subscription.cancel()
        if self._sync is not None:
            self._sync.cancel()

    # the listener

    async def listen(self, store: Store, urls: list[str]) -> None:
        """Hear announcements for good; after each (re)subscription, SCAN, then trust the filter.

        On a cluster one node's subscription hears every PUBLISH; after a failure the next seed is tried."""
        self.store = store
        loop = asyncio.get_running_loop()
        for url in itertools.cycle(urls):
            synced = functools.partial(self._subscribed, self.epoch)
            self._subscription = loop.create_task(subscribe(url, CHANNEL, synced, self.hear))
            try:
                await self._subscription
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # the gateway is stopping
                reason = "deaf: its own announcements not heard"  # cancelled by _check_heard
            except Exception as exc:  # whatever it was, the listener must live
                reason = f"{type(exc).__name__}: {exc}"
            if reason != self._said:
                log.warning("cache: presence subscription lost (%s); retrying every second", reason)
                self._said = reason
            self._untrust("the subscription was lost")
            await asyncio.sleep(RETRY_S)

    def _subscribed(self, epoch: int) -> None:
        if epoch != self.epoch or self.store is None:
            return
        self._said = ""
        self.resyncs += 1
        if self._sync is not None:
            self._sync.cancel()
        self._sync = asyncio.get_running_loop().create_task(self._synced(self.store, epoch))

    async def _synced(self, store: Store, epoch: int) -> None:
        """Add every key Redis holds, then trust the filter if the subscription has had no gap meanwhile.

        Announcements heard since the subscription began cover keys stored during the SCAN. Where no SCAN
        completes (a cluster failing over, again and again), a whole lifetime of announcements does as well."""
        loop = asyncio.get_running_loop()
        since = loop.time()
        failed = False
        while epoch == self.epoch:
            try:
                await store.scan(layout.pattern(), self.found)
            except StoreUnavailable as exc:
                if loop.time() - since < self.lifetime_s:
                    if not failed:  # once a sync, not once a second
                        log.warning("cache: presence SCAN failed (%s); trying again every second", exc)
                    failed = True
                    await asyncio.sleep(RETRY_S)
                    continue
            if epoch == self.epoch:
                self._trust(True)
                log.info("cache presence filter synced: lookups of keys no gateway stored skip Redis")
            return
