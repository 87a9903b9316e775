"""Signed webhooks for background jobs that ended: Standard Webhooks, retried with back-off, kept in the job store.

When a job run by the gateway ends (completed, incomplete, failed, cancelled), one event is posted to its
tenant's `tenants.NAME.webhook.url`, else to `background.webhook.url` (a tenant with neither gets none):

    {"id": "evt_...", "object": "event", "type": "background.completed", "created_at": 1733...,
     "data": {"id": "bgjob_...", "tenant": "acme", "model": "chat", "status": "completed"}}

(`response.completed` and so on for Responses jobs, as OpenAI names them), with the Standard Webhooks headers:
`webhook-id` (the event's id, the same on every attempt, for the receiver's deduplication), `webhook-timestamp`
(seconds, this attempt) and `webhook-signature: v1,<base64 HMAC-SHA256 of "id.timestamp.body">`, keyed by the
bytes the `whsec_` secret encodes. A 2xx answer delivers it; anything else (an error status, a refused
connection, no answer within `timeout_s`) is tried again after `first_retry_s`, doubling up to `max_retry_s`
with jitter, up to `max_attempts` times; then it is logged and moved to a dead set, never dropped silently.

Pending deliveries live where the jobs live: with Redis, in the sorted set `sluice:bg:webhooks` scored by when
each is due. An instance claims what is due by pushing its score on by a claim's length (one script), posts
it, then removes it or puts it back with its next attempt: a delivery whose instance died mid-way is due again
when its claim runs out, and any instance (a restarted one) takes it. Delivery is at least once, and every
attempt of one job's event carries the same `webhook-id` (derived from the job's id), so a receiver can drop
a repeat. Without Redis the deliveries are kept in this process only.

No event is lost between a job's end and its delivery being stored, whatever stops the process: a job's end
and its event are two writes (they live under different keys, so on a Redis Cluster one script cannot make
both), so the event is promised before the job runs. When a job starts, a *watch* for it goes into the same
set, due a little after its owner's lease would run out. The job's end replaces the watch with the event,
due now (one script). A watch that comes due means nobody replaced it: the instance that claims it reads the
job. Ended: it sends the job's event. Still running on a live owner: it looks again a lease later. Owner
gone: the job is marked failed as a read would mark it, and its event is sent. Record gone (deleted or
expired): there is no event to send, and the log says so.

When Redis is slow or down, no delivery is claimed (the poll finds nothing due) and a job's end retries storing
its event for about 9 s, then leaves it to the watch; nothing pending is lost, and delivery resumes when Redis
answers. A Redis restarted without its data (no persistence) has lost every pending delivery and watch with
the jobs themselves: that cannot be undone from here, but it is not silent. The set holds a marker that is
never due; the first claim of an instance that had seen it and finds it gone logs an error naming what was
lost. Jobs that end after the restart send their events as before.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import httpx
import orjson

from gateway.jobs.store import TERMINAL
from gateway.state.store import Script, StoreUnavailable

if TYPE_CHECKING:
    from gateway.jobs.store import Job
    from gateway.settings import WebhookSettings
    from gateway.state.store import Store

log = logging.getLogger("sluice.background")

PENDING = "sluice:bg:webhooks"
DEAD = "sluice:bg:webhooks:dead"
POLL_S = 0.5
BATCH = 32
# A member of the pending set that is never due (scored +inf): its absence tells a claim that the set was lost with
# Redis's data (a restart without persistence, a flush), since the instances last claimed.
MARKER = b"marker"
# Keys: pending. Args: now_ms, claimed_until_ms, count, the marker. The due deliveries, each claimed until the given
# time, after 1 where the marker had to be put back (the set is new, or was lost since), else 0.
CLAIM = Script(
    """
local fresh = 0
if not redis.call('ZSCORE', KEYS[1], ARGV[4]) then
  redis.call('ZADD', KEYS[1], '+inf', ARGV[4])
  fresh = 1
end
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
for _, member in ipairs(due) do redis.call('ZADD', KEYS[1], ARGV[2], member) end
return {fresh, due}
"""
)
# Keys: pending. Args: a job's watch, its event, due_ms. The job ended: its event replaces its watch.
SWAP = Script(
    """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
return 1
"""
)
# Keys: pending. Args: old member, new member, due_ms. A failed attempt put back as its next one.
RETRY = Script(
    """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2]) end
return 1
"""
)


def sign(secret: bytes, ident: str, timestamp: int, body: bytes) -> str:
    """The Standard Webhooks signature header's value."""
    digest = hmac.new(secret, f"{ident}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def secret_bytes(secret: str) -> bytes:
    return base64.b64decode(secret.removeprefix("whsec_"))


def event_id(job: str) -> str:
    """A job's event's id: the same wherever and however often its end is reported, so repeats are one event."""
    return "evt_" + hashlib.sha256(job.encode()).hexdigest()[:32]


def _fields(job: Job) -> dict[str, str]:
    kind = "response" if job.kind == "responses" else "background"
    return {"id": event_id(job.ident), "job": job.ident, "kind": kind, "tenant": job.tenant, "model": job.model}


def watch_member(job: Job) -> bytes:
    """The member that promises `job`'s event until its end replaces it (the same bytes on every instance)."""
    return orjson.dumps(_fields(job))


def event_member(job: Job, status: str) -> bytes:
    """The member of `job`'s event, once it ended with `status` (the same bytes on every instance)."""
    return orjson.dumps({**_fields(job), "status": status, "attempt": 0})


def body(delivery: dict[str, Any]) -> bytes:
    """The event as posted: the same on every attempt (its time is that of the first)."""
    data = {key: delivery[key] for key in ("tenant", "model", "status")}
    data = {"id": delivery["job"], **data}
    kind = f"{delivery['kind']}.{delivery['status']}"
    event = {"id": delivery["id"], "object": "event", "type": kind, "created_at": delivery["created_at"], "data": data}
    return orjson.dumps(event)


class Receiver:
    """One webhook's address, signing key and retry policy."""

    __slots__ = ("secret", "spec")

    def __init__(self, spec: WebhookSettings) -> None:
        self.spec = spec
        self.secret = secret_bytes(spec.secret)


class Pending(Protocol):
    async def add(self, member: bytes, due_ms: int) -> None: ...
    async def swap(self, old: bytes, new: bytes, due_ms: int) -> None: ...
    async def claim(self, now_ms: int, until_ms: int) -> tuple[bool, list[bytes]]:
        """The deliveries due, each claimed until `until_ms`, after whether the set had lost its marker."""
        ...

    async def done(self, member: bytes) -> None: ...
    async def retry(self, member: bytes, again: bytes, due_ms: int) -> None: ...
    async def dead(self, member: bytes) -> None: ...


class RedisPending:
    def __init__(self, store: Store) -> None:
        self.store = store

    async def add(self, member: bytes, due_ms: int) -> None:
        await self.store.execute("ZADD", PENDING, due_ms, member)

    async def swap(self, old: bytes, new: bytes, due_ms: int) -> None:
        await self.store.run(SWAP, [PENDING], [old, new, due_ms])

    async def claim(self, now_ms: int, until_ms: int) -> tuple[bool, list[bytes]]:
        fresh, found = await self.store.run(CLAIM, [PENDING], [now_ms, until_ms, BATCH, MARKER])
        return fresh == 1, list(found or [])

    async def done(self, member: bytes) -> None:
        await self.store.execute("ZREM", PENDING, member)

    async def retry(self, member: bytes, again: bytes, due_ms: int) -> None:
        await self.store.run(RETRY, [PENDING], [member, again, due_ms])

    async def dead(self, member: bytes) -> None:
        await self.store.pipeline([["ZREM", PENDING, member], ["LPUSH", DEAD, member], ["LTRIM", DEAD, 0, 9999]])


class MemoryPending:
    def __init__(self) -> None:
        self.due: dict[bytes, int] = {}

    async def add(self, member: bytes, due_ms: int) -> None:
        self.due[member] = due_ms

    async def swap(self, old: bytes, new: bytes, due_ms: int) -> None:
        self.due.pop(old, None)
        self.due[new] = due_ms

    async def claim(self, now_ms: int, until_ms: int) -> tuple[bool, list[bytes]]:
        found = [m for m, due in self.due.items() if due <= now_ms][:BATCH]
        for member in found:
            self.due[member] = until_ms
        return False, found  # it lives as long as this process: never lost under it

    async def done(self, member: bytes) -> None:
        self.due.pop(member, None)

    async def retry(self, member: bytes, again: bytes, due_ms: int) -> None:
        if self.due.pop(member, None) is not None:
            self.due[again] = due_ms

    async def dead(self, member: bytes) -> None:
        self.due.pop(member, None)


class Webhooks:
    """This process's share of the deliveries: it adds those of the jobs it ends, and posts whatever is due."""

    def __init__(
        self,
        spec: WebhookSettings | None,
        tenants: dict[str, WebhookSettings],
        store: Store | None,
        settle: Callable[[str], Awaitable[Job | None]],
        watch_s: float,
    ) -> None:
        self.default = None if spec is None else Receiver(spec)
        self.tenants = {tenant: Receiver(own) for tenant, own in tenants.items()}
        # The job as it stands, marked failed first if its owner is gone (None: its record is gone).
        self.settle = settle
        self.watch_ms = int(watch_s * 1000)
        longest = max(r.spec.timeout_s for r in [*self.tenants.values(), *([self.default] if self.default else [])])
        self.claim_ms = int((longest + 5.0) * 1000)
        self.pending: Pending = RedisPending(store) if store is not None else MemoryPending()
        self.wake = asyncio.Event()
        self.client: httpx.AsyncClient | None = None
        self.task: asyncio.Task[None] | None = None
        self.delivered = 0
        self.failed = 0
        self.marked = False  # a claim has seen (or put) the pending set's marker in this process's life

    def receiver(self, tenant: str) -> Receiver | None:
        """Where `tenant`'s events go, and how they are signed and retried (None: nowhere)."""
        return self.tenants.get(tenant, self.default)

    async def start(self) -> None:
        self.client = httpx.AsyncClient()
        self.task = asyncio.get_running_loop().create_task(self._deliver())

    async def started(self, job: Job) -> None:
        """A job starts: its watch goes in first, due when its owner would be found gone (see above). One try,
        before the job runs (a watch stored after the job's end would send its event twice): the job's record
        was just written to the same store, and without the watch its end is still reported as before."""
        if self.receiver(job.tenant) is None:
            return
        try:
            await self.pending.add(watch_member(job), _now_ms() + self.watch_ms)
        except StoreUnavailable as exc:
            log.warning("background job %s: its watch not stored (%s)", job.ident, exc)

    async def ended(self, job: Job, status: str) -> None:
        """A job ended: its event replaces its watch, due now. Tried while the store may be away; a watch that
        was stored makes the event even if this never is."""
        if self.receiver(job.tenant) is None:
            return
        old, new = watch_member(job), event_member(job, status)
        await self._store(job, "its event", lambda: self.pending.swap(old, new, _now_ms()))
        self.wake.set()

    async def _store(self, job: Job, what: str, write: Callable[[], Awaitable[None]]) -> None:
        for wait in (0.1, 0.5, 1.0, 2.0, 5.0, 0.0):
            try:
                await write()
                return
            except StoreUnavailable as exc:
                log.warning("background job %s: %s not stored yet (%s)", job.ident, what, exc)
                await asyncio.sleep(wait)
        log.error("background job %s: %s could not be stored", job.ident, what)

    async def _deliver(self) -> None:
        while True:
            try:
                now = _now_ms()
                fresh, due = await self.pending.claim(now, now + self.claim_ms)
            except StoreUnavailable:
                fresh, due = False, []
            else:
                if fresh and self.marked:  # this process saw the marker, and the set has lost it since
                    log.error("webhooks: Redis lost the pending deliveries (%s had lost its marker: a restart without "
                              "persistence, or a flush); events and watches pending then are not sent",
                              PENDING)  # fmt: skip
                self.marked = True
            if due:
                await asyncio.gather(*(self._post(member) for member in due))
                continue
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), POLL_S)

    async def _post(self, member: bytes) -> None:
        delivery: dict[str, Any] = orjson.loads(member)
        if "status" not in delivery:  # a watch come due: nobody has reported the job's end
            with contextlib.suppress(StoreUnavailable):  # a claim that runs out makes it due again
                await self._look(member, delivery)
            return
        receiver = self.receiver(delivery["tenant"])
        if receiver is None:  # the configuration changed since: nowhere to send it
            log.warning("webhook %s: tenant %r has no webhook now; dropped", delivery["id"], delivery["tenant"])
            with contextlib.suppress(StoreUnavailable):
                await self.pending.done(member)
            return
        delivery.setdefault("created_at", int(time.time()))
        ident, payload = delivery["id"], body(delivery)
        timestamp = int(time.time())
        headers = {
            "content-type": "application/json",
            "webhook-id": ident,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(receiver.secret, ident, timestamp, payload),
            "user-agent": "sluice-webhooks",
        }
        assert self.client is not None
        spec = receiver.spec
        try:
            response = await self.client.post(spec.url, content=payload, headers=headers, timeout=spec.timeout_s)
            failure = None if 200 <= response.status_code < 300 else f"status {response.status_code}"
        except httpx.HTTPError as exc:
            failure = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(StoreUnavailable):  # a claim that runs out makes it due again
            await self._after(member, delivery, failure, spec)

    async def _look(self, member: bytes, delivery: dict[str, Any]) -> None:
        job = await self.settle(delivery["job"])
        if job is None:
            log.warning("background job %s: its record is gone and its end was never reported: no event",
                        delivery["job"])  # fmt: skip
            await self.pending.done(member)
        elif job.status in TERMINAL:
            await self.pending.swap(member, event_member(job, job.status), _now_ms())
            self.wake.set()
        else:  # running, on a live owner: look again when its lease would next run out
            await self.pending.retry(member, member, _now_ms() + self.watch_ms)

    async def _after(self, member: bytes, delivery: dict[str, Any], failure: str | None, spec: WebhookSettings) -> None:
        if failure is None:
            self.delivered += 1
            await self.pending.done(member)
            return
        self.failed += 1
        attempt = delivery["attempt"] + 1
        if attempt >= spec.max_attempts:
            log.error("webhook %s: not delivered after %d attempts (%s); kept in %s", delivery["id"], attempt,
                      failure, DEAD)  # fmt: skip
            await self.pending.dead(member)
            return
        wait = min(spec.max_retry_s, spec.first_retry_s * 2 ** (attempt - 1))
        wait *= random.uniform(0.8, 1.2)
        log.info("webhook %s: attempt %d failed (%s); next in %.1f s", delivery["id"], attempt, failure, wait)
        again = orjson.dumps({**delivery, "attempt": attempt})
        await self.pending.retry(member, again, _now_ms() + int(wait * 1000))

    async def aclose(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task
        if self.client is not None:
            await self.client.aclose()


def _now_ms() -> int:
    return int(time.time() * 1000)
