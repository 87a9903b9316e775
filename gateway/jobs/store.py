"""Where background jobs live: their record, their events, their slots and the owners' leases, in Redis or in process.

One job's keys are hash-tagged by its id, so they share a Redis Cluster slot:
    sluice:bg:{ID}:job      hash: tenant, model, kind, owner, status, object (the response / job JSON)
    sluice:bg:{ID}:events   stream: one entry per event, entry id 0-(seq+1), field "d" the event's JSON
Per tenant, `sluice:bg:{TENANT}:inflight` holds the jobs in flight (the `max_inflight_per_tenant` cap), each
scored by when its owner's lease runs out: the owner pushes the score on at every renewal, so a dead owner's
slots are free again a lease after its last renewal. Per gateway instance, `sluice:bg:lease:{INSTANCE}` says
that the owner is alive. Everything has a TTL. A job's keys and its tenant's slots hash to different Redis
Cluster slots, so admission is two scripts: the slot is reserved under the cap first, then the record written
(`RedisJobs.create` says why that order keeps the rules).

Every write is conditional on the record, in one script: events are appended only while the job has not
ended and only by its owner, and only those not stored yet (a write that timed out may still have landed, so
the one that repeats it skips what is there); a job ends once, with its terminal status and, for Responses,
its terminal event written together. Whoever ends a job first (its owner, a cancel, an instance that found
the owner's lease expired) wins, and nothing is appended after it.

`MemoryJobs` has the same interface for a gateway without Redis; it serves a single instance only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from gateway.state.resp import ReplyError
from gateway.state.store import Script, Store, StoreUnavailable

TERMINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})

# Admission is two scripts, one per hash slot, since a job's keys and its tenant's slots live in different ones
# (docs/architecture.md, "Background mode"): the slot is reserved first, then the record is written.
# Keys: inflight. Args: cap, now, slot_until, ttl_ms, ident. 1: reserved; 0: the tenant is at its cap.
RESERVE = Script(
    """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
"""
)
# Keys: job. Args: ttl_ms, then the job's fields as name, value pairs.
CREATE = Script(
    """
local fields = {}
for i = 2, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""
)

# What the two writing scripts share: whether `owner` may still write the job, and an idempotent append.
_SHARED = """
local function live(job, owner)
  local found = redis.call('HMGET', job, 'status', 'owner')
  local status = found[1]
  if not status then return false end
  if status == 'completed' or status == 'incomplete' or status == 'failed' or status == 'cancelled' then
    return false
  end
  return found[2] == owner
end
local function append(events, maxlen, first)
  local last = -1
  local top = redis.call('XREVRANGE', events, '+', '-', 'COUNT', 1)
  if top[1] then last = tonumber(string.sub(top[1][1], 3)) - 1 end
  for i = first, #ARGV, 2 do
    local seq = tonumber(ARGV[i])
    if seq > last then
      redis.call('XADD', events, 'MAXLEN', '~', maxlen, '0-' .. (seq + 1), 'd', ARGV[i + 1])
      last = seq
    end
  end
  return last
end
"""
# Keys: job, events. Args: owner, ttl_ms, max_events, the in_progress object ('' = none), then seq, event pairs.
# 1: stored; 0: the job has ended (or is gone, or is not this owner's): the owner stops.
APPEND = Script(
    _SHARED
    + """
if not live(KEYS[1], ARGV[1]) then return 0 end
append(KEYS[2], ARGV[3], 5)
redis.call('PEXPIRE', KEYS[2], ARGV[2])
if ARGV[4] ~= '' and redis.call('HGET', KEYS[1], 'status') == 'queued' then
  redis.call('HSET', KEYS[1], 'status', 'in_progress', 'object', ARGV[4])
end
return 1
"""
)
# Keys: job, events. Args: owner, status, object, ttl_ms, max_events, the terminal event's type ('' = none
# stored: chat jobs), then seq, event pairs still to store before it. 1: this call ended the job; 0: it had
# ended already (or is gone, or is not `owner`'s).
FINISH = Script(
    _SHARED
    + """
if not live(KEYS[1], ARGV[1]) then return 0 end
local last = append(KEYS[2], ARGV[5], 7)
if ARGV[6] ~= '' then
  local seq = last + 1
  local data = 'event: ' .. ARGV[6] .. '\\ndata: {"type":"' .. ARGV[6] .. '","sequence_number":' .. seq
    .. ',"response":' .. ARGV[3] .. '}\\n\\n'
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '0-' .. (seq + 1), 'd', data)
end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'object', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return 1
"""
)


def terminal_event(kind: str, seq: int, obj: bytes) -> bytes:
    """The terminal event FINISH writes, byte for byte (for the in-process store)."""
    head = b'event: %s\ndata: {"type":"%s","sequence_number":%d,"response":' % (kind.encode(), kind.encode(), seq)
    return head + obj + b"}\n\n"


def job_key(ident: str) -> str:
    return f"sluice:bg:{{{ident}}}:job"


def events_key(ident: str) -> str:
    return f"sluice:bg:{{{ident}}}:events"


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


@dataclass(slots=True)
class Renewal:
    """What a lease renewal found."""

    lapsed: bool  # the lease had run out before this renewal: the jobs it covered are taken as lost
    ended: dict[str, str | None] = field(default_factory=dict)  # running jobs whose record ended (or is gone)
    # Running jobs whose slot had run out (its node unreachable for longer than a lease while the lease's was
    # not): it may have been given to another job, so the job is taken as lost, as under a lapsed lease.
    lost: set[str] = field(default_factory=set)


class Jobs(Protocol):
    async def create(self, job: Job, cap: int) -> bool: ...
    async def get(self, ident: str) -> Job | None: ...
    async def append(self, job: Job, events: Sequence[tuple[int, bytes]], progress: bytes | None) -> bool: ...
    async def finish(
        self, job: Job, status: str, obj: bytes, terminal: str, events: Sequence[tuple[int, bytes]] = ()
    ) -> bool: ...
    async def events(self, ident: str, after: int, count: int = 512) -> list[tuple[int, bytes]]: ...
    async def release(self, job: Job) -> None: ...
    async def delete(self, job: Job) -> None: ...
    async def renew(self, instance: str, running: Sequence[Job]) -> Renewal: ...
    async def prepare(self) -> None: ...
    async def alive(self, instance: str) -> bool: ...
    async def changed(self, ident: str, timeout: float) -> None: ...


def _pairs(events: Sequence[tuple[int, bytes]]) -> list[int | bytes]:
    return [part for seq, data in events for part in (seq, data)]


class RedisJobs:
    """Jobs in Redis, readable by every gateway instance."""

    def __init__(self, store: Store, ttl_s: float, max_events: int, lease_s: float) -> None:
        self.store = store
        self.ttl_ms = int(ttl_s * 1000)
        self.max_events = max_events
        self.lease_s = lease_s
        self.lease_ms = int(lease_s * 1000)

    async def create(self, job: Job, cap: int) -> bool:
        """Reserve the job's slot under the cap, then write its record; a record that cannot be written gives
        its slot back. Nobody knows the id before this returns, so neither half is ever seen alone: a
        reservation left behind (the give-back failed too) runs out with its lease, and a record that lands
        after its write timed out is one that no client can name, gone with its TTL."""
        slots = inflight_key(job.tenant)
        now = time.time()
        if not await self.store.run(RESERVE, [slots], [cap, now, now + self.lease_s, self.ttl_ms, job.ident]):
            return False
        try:
            await self.store.run(CREATE, [job_key(job.ident)], [self.ttl_ms, *job.fields()])
        except StoreUnavailable:
            # Around the breaker (the failure just opened it): the slot may live on another node, still up,
            # and would otherwise count against the tenant for a whole lease.
            with contextlib.suppress(StoreUnavailable):
                await self.store.pipeline([["ZREM", slots, job.ident]], always=True)
            raise
        return True

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

    async def append(self, job: Job, events: Sequence[tuple[int, bytes]], progress: bytes | None) -> bool:
        keys = [job_key(job.ident), events_key(job.ident)]
        args = [job.owner, self.ttl_ms, self.max_events, progress or b"", *_pairs(events)]
        return bool(await self.store.run(APPEND, keys, args))

    async def finish(
        self, job: Job, status: str, obj: bytes, terminal: str, events: Sequence[tuple[int, bytes]] = ()
    ) -> bool:
        keys = [job_key(job.ident), events_key(job.ident)]
        args = [job.owner, status, obj, self.ttl_ms, self.max_events, terminal, *_pairs(events)]
        return bool(await self.store.run(FINISH, keys, args))

    async def events(self, ident: str, after: int, count: int = 512) -> list[tuple[int, bytes]]:
        entries = await self.store.execute("XRANGE", events_key(ident), f"(0-{after + 1}", "+", "COUNT", count)
        found = []
        for entry_id, fields in entries or []:
            seq = int(entry_id.split(b"-")[1]) - 1
            found.append((seq, fields[1] if isinstance(fields, list) else fields[b"d"]))
        return found

    async def release(self, job: Job) -> None:
        await self.store.execute("ZREM", inflight_key(job.tenant), job.ident)

    async def delete(self, job: Job) -> None:
        """Its record (with its input items) and its events, for every instance. An owner still running it
        finds the record gone at its next renewal and stops; nothing is appended to a job without a record."""
        await self.store.pipeline([["DEL", job_key(job.ident)], ["DEL", events_key(job.ident)]])

    async def renew(self, instance: str, running: Sequence[Job]) -> Renewal:
        """The lease, the running jobs' slots and a look at their records, in one round trip the breaker lets by
        (one per node on a Redis Cluster: the lease, each tenant's slots and each job live where their keys hash)."""
        until = time.time() + self.lease_s
        lease = lease_key(instance)
        tenants = {job.tenant: None for job in running}
        # PEXPIRE answers whether the lease was still there (0: it had run out), SET makes sure it is now.
        commands: list[list[Any]] = [["PEXPIRE", lease, self.lease_ms], ["SET", lease, 1, "PX", self.lease_ms]]
        # CH: 1 if the slot was there to push on, 0 if it had run out and been dropped by an admission.
        commands += [["ZADD", inflight_key(job.tenant), "XX", "CH", until, job.ident] for job in running]
        commands += [["HGET", job_key(job.ident), "status"] for job in running]
        commands += [["PEXPIRE", inflight_key(tenant), self.ttl_ms] for tenant in tenants]  # outlive the jobs
        replies = await self.store.pipeline(commands, always=True)
        if isinstance(replies[1], ReplyError):
            raise StoreUnavailable(f"lease not renewed: {replies[1]}")
        renewal = Renewal(lapsed=replies[0] == 0)
        count = len(running)
        for job, kept, status in zip(running, replies[2 : 2 + count], replies[2 + count : 2 + 2 * count], strict=True):
            if isinstance(status, ReplyError):
                continue
            if status is None or status.decode() in TERMINAL:
                renewal.ended[job.ident] = None if status is None else status.decode()
            elif kept == 0:
                renewal.lost.add(job.ident)
        return renewal

    async def prepare(self) -> None:
        """Load the scripts now, so that the first job does not pay for it (the NOSCRIPT path still works)."""
        await self.store.pipeline([["SCRIPT", "LOAD", script.source] for script in (RESERVE, CREATE, APPEND, FINISH)])

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
        self.waiters: dict[str, asyncio.Event] = {}

    def _expire(self) -> None:
        now = time.monotonic()
        for ident in [i for i, (_, until) in self.jobs.items() if until < now]:
            self.jobs.pop(ident, None)
            self.streams.pop(ident, None)

    def _wake(self, ident: str) -> None:
        waiter = self.waiters.pop(ident, None)
        if waiter is not None:
            waiter.set()

    def _live(self, job: Job) -> Job | None:
        found = self.jobs.get(job.ident)
        if found is None or found[0].status in TERMINAL or found[0].owner != job.owner:
            return None
        return found[0]

    def _append(self, ident: str, events: Sequence[tuple[int, bytes]]) -> int:
        stream = self.streams.setdefault(ident, [])
        last = stream[-1][0] if stream else -1
        for seq, data in events:
            if seq > last:
                stream.append((seq, data))
                last = seq
        if len(stream) > self.max_events:
            del stream[: len(stream) - self.max_events]
        return last

    async def create(self, job: Job, cap: int) -> bool:
        self._expire()
        running = sum(1 for j, _ in self.jobs.values() if j.tenant == job.tenant and j.status not in TERMINAL)
        if running >= cap:
            return False
        self.jobs[job.ident] = (replace(job), time.monotonic() + self.ttl_s)
        self.streams[job.ident] = []
        return True

    async def get(self, ident: str) -> Job | None:
        found = self.jobs.get(ident)
        return replace(found[0]) if found is not None and found[1] >= time.monotonic() else None

    async def append(self, job: Job, events: Sequence[tuple[int, bytes]], progress: bytes | None) -> bool:
        found = self._live(job)
        if found is None:
            return False
        self._append(job.ident, events)
        if progress is not None and found.status == "queued":
            found.status, found.object = "in_progress", progress
        self._wake(job.ident)
        return True

    async def finish(
        self, job: Job, status: str, obj: bytes, terminal: str, events: Sequence[tuple[int, bytes]] = ()
    ) -> bool:
        found = self._live(job)
        if found is None:
            return False
        last = self._append(job.ident, events)
        if terminal:
            self._append(job.ident, [(last + 1, terminal_event(terminal, last + 1, obj))])
        self.jobs[job.ident] = (replace(found, status=status, object=obj), time.monotonic() + self.ttl_s)
        self._wake(job.ident)
        return True

    async def events(self, ident: str, after: int, count: int = 512) -> list[tuple[int, bytes]]:
        return [event for event in self.streams.get(ident, []) if event[0] > after][:count]

    async def release(self, job: Job) -> None:
        return None  # the in-flight count is taken from the statuses

    async def delete(self, job: Job) -> None:
        self.jobs.pop(job.ident, None)
        self.streams.pop(job.ident, None)
        self._wake(job.ident)

    async def renew(self, instance: str, running: Sequence[Job]) -> Renewal:
        ended: dict[str, str | None] = {}
        for job in running:
            found = self.jobs.get(job.ident)
            if found is None or found[0].status in TERMINAL:
                ended[job.ident] = None if found is None else found[0].status
        return Renewal(lapsed=False, ended=ended)

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
