"""Which tenant and model created a response id: routes its retrievals and keeps them to that tenant.

The id is taken from the first `"id": "resp_..."` of every Responses answer as it passes (one regex on the
first chunk), and kept in process and, when Redis is configured, under `sluice:resp:{ID}:owner` with
`responses.index_ttl_s`, so that every instance can route a retrieval of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from gateway.state.store import StoreUnavailable

if TYPE_CHECKING:
    from gateway.context import Exchange, Target
    from gateway.state.store import Store
    from gateway.upstream.providers.base import Provider, UpstreamResponse

log = logging.getLogger("sluice.responses")

# The response's own id: the first `"id": "resp_..."` of a body or stream (item ids have other prefixes,
# and `"previous_response_id"` does not match because of the quote before `id`).
CREATED_ID = re.compile(rb'"id":\s*"(resp_[A-Za-z0-9_-]{1,128})"')
INDEX_ENTRIES = 100_000  # in-process entries, newest kept


def index_key(ident: str) -> str:
    # Hash-tagged by the id, like every key of one response, so that they share a Redis Cluster slot.
    return f"sluice:resp:{{{ident}}}:owner"


@dataclass(frozen=True, slots=True)
class Owner:
    tenant: str
    model: str
    job: bool = False  # a background job run by the gateway, not a response stored by a backend


class ResponseIndex:
    """Which tenant and model created a response id."""

    def __init__(self, store: Store | None, ttl_s: float) -> None:
        self.store = store
        self.ttl_ms = int(ttl_s * 1000)
        self.local: OrderedDict[str, Owner] = OrderedDict()
        self._writes: set[asyncio.Task[None]] = set()

    def note(self, ident: str, owner: Owner) -> None:
        """Remember `ident` now in process, and in Redis in the background."""
        self._local(ident, owner)
        if self.store is not None:
            task = asyncio.get_running_loop().create_task(self._write(ident, owner))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    async def note_now(self, ident: str, owner: Owner) -> None:
        """Remember `ident` before answering: a background job is polled at once, perhaps on another instance."""
        self._local(ident, owner)
        if self.store is not None:
            await self._write(ident, owner)

    def _local(self, ident: str, owner: Owner) -> None:
        self.local[ident] = owner
        if len(self.local) > INDEX_ENTRIES:
            self.local.popitem(last=False)

    async def _write(self, ident: str, owner: Owner) -> None:
        assert self.store is not None
        record = orjson.dumps({"tenant": owner.tenant, "model": owner.model, "job": owner.job})
        try:
            await self.store.execute("SET", index_key(ident), record, "PX", self.ttl_ms)
        except StoreUnavailable:
            log.info("response %s: not indexed in redis (unavailable); known to this process only", ident)

    async def lookup(self, ident: str) -> Owner | None:
        found = self.local.get(ident)
        if found is not None or self.store is None:
            return found
        try:
            raw = await self.store.execute("GET", index_key(ident))
        except StoreUnavailable:
            return None
        if raw is None:
            return None
        try:
            record = orjson.loads(raw)
            return Owner(str(record["tenant"]), str(record["model"]), bool(record.get("job")))
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return None

    async def forget(self, ident: str) -> None:
        self.local.pop(ident, None)
        if self.store is not None:
            with contextlib.suppress(StoreUnavailable):
                await self.store.execute("DEL", index_key(ident))

    async def aclose(self) -> None:
        for task in list(self._writes):
            await asyncio.gather(task, return_exceptions=True)


class Noted:
    """An upstream response whose first chunk is searched for the created response's id, once."""

    __slots__ = ("_found", "_inner", "_note", "acquire_ms", "headers", "status")

    def __init__(self, inner: UpstreamResponse, note: Any) -> None:
        self._inner = inner
        self._note = note
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
        return chunk

    async def read(self) -> bytes:
        body = await self._inner.read()
        self._look(body[:4096])
        return body

    def close(self) -> None:
        self._inner.close()


class Indexing:
    """A provider seen through the Responses API: created ids are noted with the tenant and model."""

    def __init__(self, inner: Provider, index: ResponseIndex) -> None:
        self.inner = inner
        self.index = index
        self.kind = inner.kind
        self.system = inner.system
        self.url = getattr(inner, "url", None)  # read by tracing for the server address
        self.health = inner.health  # read by the attempt loop: a backend known down is tried last
        self.reports_usage = inner.reports_usage
        self.usage_of_first_choice = inner.usage_of_first_choice

    async def send(self, ex: Exchange, target: Target) -> UpstreamResponse:
        response = await self.inner.send(ex, target)
        if response.status >= 400:
            return response
        owner = Owner(ex.tenant, target.model)
        return Noted(response, lambda ident: self.index.note(ident, owner))
