"""Where background jobs live: their record, their events and the owners' leases, in Redis or in process.

One job's keys are hash-tagged by its id, so they share a Redis Cluster slot:
    sluice:bg:{ID}:job      hash: tenant, model, kind, owner, status, object (the response / job JSON)
    sluice:bg:{ID}:events   stream: one entry per event, entry id 0-(seq+1), field "d" the event's JSON
    sluice:bg:{ID}:cancel   set by a cancel on any instance, read by the owner's lease loop
Per tenant, `sluice:bg:{TENANT}:inflight` (a sorted set of job ids by start time) enforces the in-flight cap,
and per gateway instance `sluice:bg:lease:{INSTANCE}` says that the owner is alive. Everything has a TTL.

`MemoryJobs` has the same interface for a gateway without Redis; it serves a single instance only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from gateway.state.store import Script, Store

TERMINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})

# Keys: job, inflight. Args: cap, now, max_age_s, ttl_ms, then the job's fields as name, value pairs.
CREATE = Script(
    """
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[2] - ARGV[3])
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[6])
local fields = {}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return 1
"""
)
# Keys: job. Args: status, object, ttl_ms. A job's first terminal status wins: a cancel and the end race.
UPDATE = Script(
    """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 0 end
if status == 'completed' or status == 'incomplete' or status == 'failed' or status == 'cancelled' then
  return 0
end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'object', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""
)


def job_key(ident: str) -> str:
    return f"sluice:bg:{{{ident}}}:job"


def events_key(ident: str) -> str:
    return f"sluice:bg:{{{ident}}}:events"


def cancel_key(ident: str) -> str:
    return f"sluice:bg:{{{ident}}}:cancel"


def inflight_key(tenant: str) -> str:
    return f"sluice:bg:{{{tenant}}}:inflight"


def lease_key(instance: str) -> str:
    return f"sluice:bg:lease:{instance}"


@dataclass(slots=True)
class Job:
    ident: str
    kind: str  # "responses" or "chat/completions"
    tenant: str
    model: str
    owner: str  # the instance running it
    status: str
    object: bytes  # the response object (Responses) or the job's status document (chat), as JSON
    input: bytes = b"null"  # the request's input items (Responses), for input_items

    def fields(self) -> list[str | bytes]:
        return ["id", self.ident, "kind", self.kind, "tenant", self.tenant, "model", self.model,
                "owner", self.owner, "status", self.status, "object", self.object, "input", self.input]  # fmt: skip


class Jobs(Protocol):
    async def create(self, job: Job, cap: int, max_age_s: float) -> bool: ...
    async def get(self, ident: str) -> Job | None: ...
    async def append(self, ident: str, events: Sequence[tuple[int, bytes]]) -> None: ...
    async def events(self, ident: str, after: int, count: int = 512) -> list[tuple[int, bytes]]: ...
    async def update(self, job: Job, status: str, obj: bytes) -> bool: ...
    async def release(self, job: Job) -> None: ...
    async def request_cancel(self, ident: str) -> None: ...
    async def cancel_requested(self, idents: Sequence[str]) -> set[str]: ...
    async def renew(self, instance: str) -> None: ...
    async def prepare(self) -> None: ...
    async def alive(self, instance: str) -> bool: ...
    async def changed(self, ident: str, timeout: float) -> None: ...


class RedisJobs:
    """Jobs in Redis, readable by every gateway instance."""

    def __init__(self, store: Store, ttl_s: float, max_events: int, lease_s: float) -> None:
        self.store = store
        self.ttl_ms = int(ttl_s * 1000)
        self.max_events = max_events
        self.lease_ms = int(lease_s * 1000)

    async def create(self, job: Job, cap: int, max_age_s: float) -> bool:
        keys = [job_key(job.ident), inflight_key(job.tenant)]
        args: list[str | bytes | int | float] = [cap, time.time(), max_age_s, self.ttl_ms, *job.fields()]
        return bool(await self.store.run(CREATE, keys, args))

    async def get(self, ident: str) -> Job | None:
        raw = await self.store.execute("HGETALL", job_key(ident))
        if not raw:
            return None
        values: dict[bytes, bytes] = dict(zip(raw[::2], raw[1::2], strict=True)) if isinstance(raw, list) else raw
        text = {k.decode(): v for k, v in values.items()}
        try:
            return Job(
                ident,
                text["kind"].decode(),
                text["tenant"].decode(),
                text["model"].decode(),
                text["owner"].decode(),
                text["status"].decode(),
                text["object"],
                text.get("input", b"null"),
            )
        except KeyError:
            return None

    async def append(self, ident: str, events: Sequence[tuple[int, bytes]]) -> None:
        key = events_key(ident)
        commands: list[list[Any]] = [
            ["XADD", key, "MAXLEN", "~", self.max_events, f"0-{seq + 1}", "d", data] for seq, data in events
        ]
        commands.append(["PEXPIRE", key, self.ttl_ms])
        await self.store.pipeline(commands)

    async def events(self, ident: str, after: int, count: int = 512) -> list[tuple[int, bytes]]:
        entries = await self.store.execute("XRANGE", events_key(ident), f"(0-{after + 1}", "+", "COUNT", count)
        found = []
        for entry_id, fields in entries or []:
            seq = int(entry_id.split(b"-")[1]) - 1
            found.append((seq, fields[1] if isinstance(fields, list) else fields[b"d"]))
        return found

    async def update(self, job: Job, status: str, obj: bytes) -> bool:
        """Set the status and object unless the job has already ended; whether it was set."""
        return bool(await self.store.run(UPDATE, [job_key(job.ident)], [status, obj, self.ttl_ms]))

    async def release(self, job: Job) -> None:
        await self.store.execute("ZREM", inflight_key(job.tenant), job.ident)

    async def request_cancel(self, ident: str) -> None:
        await self.store.execute("SET", cancel_key(ident), 1, "PX", self.ttl_ms)

    async def cancel_requested(self, idents: Sequence[str]) -> set[str]:
        if not idents:
            return set()
        found = await self.store.pipeline([["EXISTS", cancel_key(ident)] for ident in idents])
        return {ident for ident, hit in zip(idents, found, strict=True) if hit == 1}

    async def renew(self, instance: str) -> None:
        await self.store.execute("SET", lease_key(instance), 1, "PX", self.lease_ms)

    async def prepare(self) -> None:
        """Load the scripts now, so that the first job does not pay for it (the NOSCRIPT path still works)."""
        await self.store.pipeline([["SCRIPT", "LOAD", script.source] for script in (CREATE, UPDATE)])

    async def alive(self, instance: str) -> bool:
        return bool(await self.store.execute("EXISTS", lease_key(instance)))

    async def changed(self, ident: str, timeout: float) -> None:
        # Followers poll: a blocking XREAD would stall a shared, multiplexed store connection (and time out).
        await asyncio.sleep(min(timeout, 0.05))


class MemoryJobs:
    """Jobs in this process: the same interface, for a single gateway instance without Redis."""

    def __init__(self, ttl_s: float, max_events: int) -> None:
        self.ttl_s = ttl_s
        self.max_events = max_events
        self.jobs: dict[str, tuple[Job, float]] = {}
        self.streams: dict[str, list[tuple[int, bytes]]] = {}
        self.cancels: set[str] = set()
        self.waiters: dict[str, asyncio.Event] = {}

    def _expire(self) -> None:
        now = time.monotonic()
        for ident in [i for i, (_, until) in self.jobs.items() if until < now]:
            self.jobs.pop(ident, None)
            self.streams.pop(ident, None)
            self.cancels.discard(ident)

    def _wake(self, ident: str) -> None:
        waiter = self.waiters.pop(ident, None)
        if waiter is not None:
            waiter.set()

    async def create(self, job: Job, cap: int, max_age_s: float) -> bool:
        self._expire()
        running = sum(1 for j, _ in self.jobs.values() if j.tenant == job.tenant and j.status not in TERMINAL)
        if running >= cap:
            return False
        self.jobs[job.ident] = (replace(job), time.monotonic() + self.ttl_s)
        self.streams[job.ident] = []
        return True

    async def get(self, ident: str) -> Job | None:
        found = self.jobs.get(ident)
        return found[0] if found is not None and found[1] >= time.monotonic() else None

    async def append(self, ident: str, events: Sequence[tuple[int, bytes]]) -> None:
        stream = self.streams.setdefault(ident, [])
        stream.extend(events)
        if len(stream) > self.max_events:
            del stream[: len(stream) - self.max_events]
        self._wake(ident)

    async def events(self, ident: str, after: int, count: int = 512) -> list[tuple[int, bytes]]:
        return [event for event in self.streams.get(ident, []) if event[0] > after][:count]

    async def update(self, job: Job, status: str, obj: bytes) -> bool:
        found = self.jobs.get(job.ident)
        if found is None or found[0].status in TERMINAL:
            return False
        self.jobs[job.ident] = (replace(found[0], status=status, object=obj), time.monotonic() + self.ttl_s)
        self._wake(job.ident)
        return True

    async def release(self, job: Job) -> None:
        return None  # the in-flight count is taken from the statuses

    async def request_cancel(self, ident: str) -> None:
        self.cancels.add(ident)

    async def cancel_requested(self, idents: Sequence[str]) -> set[str]:
        return {ident for ident in idents if ident in self.cancels}

    async def renew(self, instance: str) -> None:
        return None

    async def prepare(self) -> None:
        return None

    async def alive(self, instance: str) -> bool:
        return True  # the only owner is this process, which is running

    async def changed(self, ident: str, timeout: float) -> None:
        waiter = self.waiters.get(ident)
        if waiter is None:
            waiter = self.waiters[ident] = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(waiter.wait(), timeout)
