"""Signed webhooks for background jobs that ended: Standard Webhooks, retried with back-off, kept in the job store.

When a job run by the gateway ends (completed, incomplete, failed, cancelled), one event is posted to
`background.webhook.url`:

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
when its claim runs out, and any instance (a restarted one) takes it. Delivery is at least once. Without
Redis the deliveries are kept in this process only.
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
from typing import TYPE_CHECKING, Any, Protocol

import httpx
import orjson

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
# Keys: pending. Args: now_ms, claimed_until_ms, count. The due deliveries, each claimed until the given time.
CLAIM = Script(
    """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
for _, member in ipairs(due) do redis.call('ZADD', KEYS[1], ARGV[2], member) end
return due
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


def event(job: Job, status: str) -> tuple[str, bytes]:
    """The event for a job that ended with `status`: its id and its body."""
    ident = "evt_" + f"{random.getrandbits(128):032x}"
    kind = "response" if job.kind == "responses" else "background"
    data = {"id": job.ident, "tenant": job.tenant, "model": job.model, "status": status}
    body = {"id": ident, "object": "event", "type": f"{kind}.{status}", "created_at": int(time.time()), "data": data}
    return ident, orjson.dumps(body)


class Pending(Protocol):
    async def add(self, member: bytes, due_ms: int) -> None: ...
    async def claim(self, now_ms: int, until_ms: int) -> list[bytes]: ...
    async def done(self, member: bytes) -> None: ...
    async def retry(self, member: bytes, again: bytes, due_ms: int) -> None: ...
    async def dead(self, member: bytes) -> None: ...


class RedisPending:
    def __init__(self, store: Store) -> None:
        self.store = store

    async def add(self, member: bytes, due_ms: int) -> None:
        await self.store.execute("ZADD", PENDING, due_ms, member)

    async def claim(self, now_ms: int, until_ms: int) -> list[bytes]:
        found = await self.store.run(CLAIM, [PENDING], [now_ms, until_ms, BATCH])
        return list(found or [])

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

    async def claim(self, now_ms: int, until_ms: int) -> list[bytes]:
        found = [m for m, due in self.due.items() if due <= now_ms][:BATCH]
        for member in found:
            self.due[member] = until_ms
        return found

    async def done(self, member: bytes) -> None:
        self.due.pop(member, None)

    async def retry(self, member: bytes, again: bytes, due_ms: int) -> None:
        if self.due.pop(member, None) is not None:
            self.due[again] = due_ms

    async def dead(self, member: bytes) -> None:
        self.due.pop(member, None)


class Webhooks:
    """This process's share of the deliveries: it adds those of the jobs it ends, and posts whatever is due."""

    def __init__(self, spec: WebhookSettings, store: Store | None) -> None:
        self.spec = spec
        self.secret = secret_bytes(spec.secret)
        self.pending: Pending = RedisPending(store) if store is not None else MemoryPending()
        self.wake = asyncio.Event()
        self.client: httpx.AsyncClient | None = None
        self.task: asyncio.Task[None] | None = None
        self.delivered = 0
        self.failed = 0

    async def start(self) -> None:
        self.client = httpx.AsyncClient(timeout=self.spec.timeout_s)
        self.task = asyncio.get_running_loop().create_task(self._deliver())

    async def ended(self, job: Job, status: str) -> None:
        """A job ended: its event is due now. Tried for as long as the store may be away (it must not be lost)."""
        ident, body = event(job, status)
        member = orjson.dumps({"id": ident, "attempt": 0, "body": body.decode()})
        for wait in (0.1, 0.5, 1.0, 2.0, 5.0):
            try:
                await self.pending.add(member, _now_ms())
                self.wake.set()
                return
            except StoreUnavailable as exc:
                log.warning("background job %s: its webhook not stored yet (%s)", job.ident, exc)
                await asyncio.sleep(wait)
        log.error("background job %s: its webhook %s could not be stored: not sent", job.ident, ident)

    async def _deliver(self) -> None:
        claim_ms = int((self.spec.timeout_s + 5.0) * 1000)
        while True:
            try:
                now = _now_ms()
                due = await self.pending.claim(now, now + claim_ms)
            except StoreUnavailable:
                due = []
            if due:
                await asyncio.gather(*(self._post(member) for member in due))
                continue
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), POLL_S)

    async def _post(self, member: bytes) -> None:
        delivery: dict[str, Any] = orjson.loads(member)
        ident, body = delivery["id"], delivery["body"].encode()
        timestamp = int(time.time())
        headers = {
            "content-type": "application/json",
            "webhook-id": ident,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(self.secret, ident, timestamp, body),
            "user-agent": "sluice-webhooks",
        }
        assert self.client is not None
        try:
            response = await self.client.post(self.spec.url, content=body, headers=headers)
            failure = None if 200 <= response.status_code < 300 else f"status {response.status_code}"
        except httpx.HTTPError as exc:
            failure = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(StoreUnavailable):  # a claim that runs out makes it due again
            await self._after(member, delivery, failure)

    async def _after(self, member: bytes, delivery: dict[str, Any], failure: str | None) -> None:
        if failure is None:
            self.delivered += 1
            await self.pending.done(member)
            return
        self.failed += 1
        attempt = delivery["attempt"] + 1
        if attempt >= self.spec.max_attempts:
            log.error("webhook %s: not delivered after %d attempts (%s); kept in %s", delivery["id"], attempt,
                      failure, DEAD)  # fmt: skip
            await self.pending.dead(member)
            return
        wait = min(self.spec.max_retry_s, self.spec.first_retry_s * 2 ** (attempt - 1))
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
