"""Who owns each stored object: the tenant and model that created a response id (and its output items).

The id is taken from the first `"id": "resp_..."` of every Responses answer as it passes (one regex on the
first chunk), and the ids of its output items from the body (a stream: the `response.output_item.added`
events). With Redis they live under `sluice:resp:{ID}:owner` and `sluice:item:{ID}:owner`, with
`responses.index_ttl_s`; without Redis, in process.

These records decide who may see or change an object, so they fail closed: with Redis configured it is
the only authority (no in-process copy that a DELETE on another instance could leave behind), a lookup
that cannot reach it raises `StoreUnavailable` (the caller answers 503), and an id without a record is
unknown. What this process noted but could not yet write (Redis down or slow when the answer passed) is
kept, bounded, in `pending`: read here first and written as soon as Redis takes it, so nothing noted is
lost while the process lives, and a DELETE is kept the same way until it is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from gateway.state.store import StoreUnavailable
from gateway.upstream.providers.base import View

if TYPE_CHECKING:
    from gateway.context import Exchange, Target
    from gateway.state.store import Store
    from gateway.upstream.providers.base import Provider, UpstreamResponse

log = logging.getLogger("sluice.responses")

# The response's own id: the first `"id": "resp_..."` of a body or stream (item ids have other prefixes,
# and `"previous_response_id"` does not match because of the quote before `id`).
CREATED_ID = re.compile(rb'"id":\s*"(resp_[A-Za-z0-9_-]{1,128})"')
# An output item's id (msg_, fc_, rs_, ...): not the response's, nor a conversation's or a prompt's it echoes.
ITEM_ID = re.compile(rb'"id":\s*"((?!resp_|conv_|pmpt_)[A-Za-z]{1,16}_[A-Za-z0-9_-]{1,128})"')
ITEM_ADDED = b"response.output_item.added"
INDEX_ENTRIES = 100_000  # in-process entries without Redis, newest kept
MAX_PENDING = 10_000  # records noted but not yet written to Redis; past this, stored creates are refused
RETRY_S = 0.25  # how soon a write Redis refused is tried again
BATCH = 256  # records written in one pipelined round trip


def index_key(ident: str) -> str:
    # Hash-tagged by the id, like every key of one response, so that they share a Redis Cluster slot.
    return f"sluice:resp:{{{ident}}}:owner"


def item_key(ident: str) -> str:
    return f"sluice:item:{{{ident}}}:owner"


@dataclass(frozen=True, slots=True)
class Owner:
    tenant: str
    model: str
    job: bool = False  # a background job run by the gateway, not a response stored by a backend


def _record(owner: Owner) -> bytes:
    return orjson.dumps({"tenant": owner.tenant, "model": owner.model, "job": owner.job})


def _owner(raw: Any) -> Owner | None:
    if raw is None:
        return None
    try:
        record = orjson.loads(raw)
        return Owner(str(record["tenant"]), str(record["model"]), bool(record.get("job")))
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None  # unreadable: unknown, as if absent (never a guess at its owner)


class ResponseIndex:
    """Which tenant and model created a response id or an output item."""

    def __init__(self, store: Store | None, ttl_s: float) -> None:
        self.store = store
        self.ttl_ms = int(ttl_s * 1000)
        self.local: OrderedDict[str, bytes] = OrderedDict()  # the authority without Redis; unused with it
        self.pending: dict[str, bytes | None] = {}  # key -> record to SET, or None to DEL, not yet written
        self.dropped = 0  # records that found `pending` full (logged); counted for tests and metrics
        self._wake: asyncio.Event | None = None
        self._writer: asyncio.Task[None] | None = None
        self._unwritten_logged = False

    @property
    def full(self) -> bool:
        """Whether a new record could not even be kept until Redis takes it."""
        return len(self.pending) >= MAX_PENDING

    async def start(self) -> None:
        if self.store is not None:
            self._wake = asyncio.Event()
            self._writer = asyncio.get_running_loop().create_task(self._write_pending())

    # Writing

    def note(self, ident: str, owner: Owner) -> None:
        """Remember `ident` (a response id): in process at once, in Redis in the background."""
        self._put(index_key(ident), _record(owner))

    def note_items(self, idents: Sequence[str], owner: Owner) -> None:
        record = _record(owner)
        for ident in idents:
            self._put(item_key(ident), record)

    async def note_now(self, ident: str, owner: Owner) -> None:
        """Remember `ident` before answering: a background job is polled at once, perhaps on another instance."""
        key = index_key(ident)
        self._put(key, _record(owner))
        await self._write_now(key)

    async def forget(self, ident: str) -> None:
        """Forget `ident` everywhere: written at once when Redis takes it, else kept and retried."""
        key = index_key(ident)
        if self.store is None:
            self.local.pop(key, None)
            return
        self._put(key, None)
        await self._write_now(key)

    def _put(self, key: str, record: bytes | None) -> None:
        if self.store is None:
            assert record is not None
            self.local[key] = record
            self.local.move_to_end(key)
            if len(self.local) > INDEX_ENTRIES:
                self.local.popitem(last=False)
            return
        if key not in self.pending and self.full:
            self.dropped += 1
            log.warning("index: %d records not yet written to redis; %s not kept", len(self.pending), key)
            return
        self.pending[key] = record
        if self._wake is not None:
            self._wake.set()

    async def _write_now(self, key: str) -> None:
        if key not in self.pending:
            return
        record = self.pending[key]
        with contextlib.suppress(StoreUnavailable):
            await self._send({key: record})

    async def _send(self, batch: dict[str, bytes | None]) -> bool:
        """Write `batch`; what Redis took leaves `pending` (unless it changed meanwhile). Whether it took all."""
        assert self.store is not None
        commands: list[list[Any]] = [
            ["SET", key, record, "PX", self.ttl_ms] if record is not None else ["DEL", key]
            for key, record in batch.items()
        ]
        replies = await self.store.pipeline(commands)
        refused = 0
        for (key, record), reply in zip(batch.items(), replies, strict=True):
            if isinstance(reply, Exception):  # an error reply (out of memory, read-only replica): kept, retried
                refused += 1
            elif key in self.pending and self.pending[key] is record:
                del self.pending[key]
        if self._unwritten_logged and not self.pending:
            self._unwritten_logged = False
            log.warning("index: every record kept while redis was unavailable is now written")
        return not refused

    async def _write_pending(self) -> None:
        """The background writer: whatever is pending, in batches, retried until Redis takes it."""
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.pending:
                batch = dict(list(self.pending.items())[:BATCH])
                try:
                    if not await self._send(batch):
                        if not self._unwritten_logged:  # once, until everything is written
                            self._unwritten_logged = True
                            log.warning("index: redis refused %d ownership record(s); retrying", len(self.pending))
                        await asyncio.sleep(RETRY_S)
                except StoreUnavailable as exc:
                    if not self._unwritten_logged:
                        self._unwritten_logged = True
                        log.warning(
                            "index: redis unavailable (%s); %d ownership record(s) kept in process until it is back",
                            exc,
                            len(self.pending),
                        )
                    await asyncio.sleep(RETRY_S)

    # Reading

    async def lookup(self, ident: str) -> Owner | None:
        """The owner of a response id, None if it has none; raises StoreUnavailable when it cannot be read."""
        return (await self.owners([index_key(ident)]))[0]

    async def owners(self, keys: Sequence[str]) -> list[Owner | None]:
        """The owner behind each key, in one round trip at most; StoreUnavailable when Redis cannot answer."""
        if self.store is None:
            return [_owner(self.local.get(key)) for key in keys]
        found: list[Owner | None] = [None] * len(keys)
        ask: list[int] = []
        for i, key in enumerate(keys):
            if key in self.pending:
                found[i] = _owner(self.pending[key])  # newer than what Redis holds (or not yet there)
            else:
                ask.append(i)
        if len(ask) == 1:
            found[ask[0]] = _owner(await self.store.execute("GET", keys[ask[0]]))
        elif ask:
            replies = await self.store.pipeline([["GET", keys[i]] for i in ask])
            for i, reply in zip(ask, replies, strict=True):
                if isinstance(reply, Exception):
                    raise StoreUnavailable(str(reply))
                found[i] = _owner(reply)
        return found

    async def aclose(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
        if self.pending:
            with contextlib.suppress(StoreUnavailable):
                await self._send(dict(self.pending))
            if self.pending:
                unwritten = len(self.pending)
                log.warning("index: %d ownership record(s) could not be written to redis at shutdown", unwritten)


class Noted:
    """An upstream response searched for the created response's id (its first chunk) and its output items."""

    __slots__ = ("_found", "_inner", "_items", "_note", "acquire_ms", "headers", "status")

    def __init__(
        self, inner: UpstreamResponse, note: Callable[[str], None], items: Callable[[list[str]], None]
    ) -> None:
        self._inner = inner
        self._note = note
        self._items = items
        self._found = False
        self.status = inner.status
        self.headers = inner.headers
        self.acquire_ms = inner.acquire_ms

    @property
    def complete(self) -> bool:
        return self._inner.complete

    @complete.setter
    def complete(self, value: bool) -> None:
        self._inner.complete = value

    def _look(self, data: bytes) -> None:
        found = CREATED_ID.search(data)
        if found is not None:
            self._found = True
            self._note(found.group(1).decode())

    async def next_chunk(self) -> bytes:
        chunk = await self._inner.next_chunk()
        if not self._found:
            self._look(chunk)
        if ITEM_ADDED in chunk:  # a stream names each output item as it starts
            self._items([m.decode() for m in ITEM_ID.findall(chunk)])
        return chunk

    async def read(self) -> bytes:
        body = await self._inner.read()
        self._look(body[:4096])
        if self._found:
            self._items([m.decode() for m in ITEM_ID.findall(body)])
        return body

    def close(self) -> None:
        self._inner.close()


class Indexing(View):
    """A provider seen through the Responses API: created ids are noted with the tenant and model."""

    def __init__(self, inner: Provider, index: ResponseIndex) -> None:
        super().__init__(inner)
        self.index = index

    async def send(self, ex: Exchange, target: Target) -> UpstreamResponse:
        response = await self.inner.send(ex, target)
        # As noted() below, inline: the HTTP path pays no extra call.
        if response.status >= 400 or ex.json.get("store") is False:  # nothing stored: nothing to own
            return response
        owner = Owner(ex.tenant, target.model)
        index = self.index
        return Noted(response, lambda ident: index.note(ident, owner), lambda items: index.note_items(items, owner))

    def noted(self, response: UpstreamResponse, ex: Exchange, target: Target) -> UpstreamResponse:
        """`response`, read for the ids it creates (also one that came another way: a pinned upstream socket)."""
        if response.status >= 400 or ex.json.get("store") is False:  # nothing stored: nothing to own
            return response
        owner = Owner(ex.tenant, target.model)
        index = self.index
        return Noted(response, lambda ident: index.note(ident, owner), lambda items: index.note_items(items, owner))
