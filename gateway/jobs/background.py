"""Background mode run by the gateway, for backends that do not have it (vLLM, simulated, chat-only).

`POST /v1/responses` with `background: true` (or `POST /v1/chat/completions` with `x-sluice-background:
true`) is admitted by the pipeline as usual (auth, rate limits), then its one target is a `Starter`: it
records the job (`gateway.jobs.store`), starts a task owned by this process that streams the request from
the model's real targets and stores every event with its sequence number, and answers at once: the queued
response object (or, for `stream: true`, the live stream of its events), or `202 Accepted` with a
`Location` for chat. Polls, resumes and cancels reach the job through the pipeline's dispatch (stored.py), on
any instance.

The task is bounded (`background.max_seconds`, the tenant's `max_inflight_per_tenant`); while it runs, this
instance renews its lease and its jobs' slots every `lease_s / 3`, on a path the store's breaker does not
block, and retries a failed renewal every 0.1 s. The same round trip reads each running job's status: a job
that ended elsewhere (cancelled, or failed by an instance that found our lease expired) is stopped at once
and its upstream request closed, as is every job of a lease that lapsed (this process paused, or the store
away, longer than `lease_s`). A write that finds the job ended stops it the same way. A reader that finds a
job running on an instance whose lease has expired marks it failed, so a job never stays in progress after
its owner died, and the dead owner's slots are free a lease after its last renewal. On a graceful shutdown
the owner marks its unfinished jobs failed at once (they cannot be finished elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from gateway import errors
from gateway.context import Exchange
from gateway.jobs.recorder import (
    RETRY_S,
    Bounds,
    Ended,
    Outcome,
    Overflow,
    Recorder,
    failed_document,
    input_items,
    queued_response,
    store_error,
)
from gateway.jobs.store import TERMINAL, Job, Jobs, MemoryJobs, RedisJobs
from gateway.jobs.webhooks import Webhooks
from gateway.state.store import StoreUnavailable
from gateway.upstream.connection import PoolError

if TYPE_CHECKING:
    from gateway.context import Target
    from gateway.settings import Settings
    from gateway.state.store import Store
    from gateway.upstream.attempts import Upstreams
    from gateway.upstream.providers.base import UpstreamResponse

log = logging.getLogger("sluice.background")

JSON = b"application/json"
SSE = b"text/event-stream"
SHUTDOWN_ERROR = {"code": "gateway_shutdown", "message": "the gateway instance running it shut down"}
ENDED_ELSEWHERE = "background job %s: stopped and its upstream closed: its record had ended (or is gone)"
LOST_ERROR = {"code": "owner_lost", "message": "the gateway instance running it stopped (its lease expired)"}


class Canned:
    """A whole answer made here, in the shape of an upstream response."""

    __slots__ = ("_body", "acquire_ms", "complete", "headers", "status")

    def __init__(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.status = status
        self.headers = [(b"content-type", JSON), *(headers or [])]
        self._body = body
        self.complete = False
        self.acquire_ms = 0.0

    async def next_chunk(self) -> bytes:
        body, self._body = self._body, b""
        self.complete = not body
        return body

    async def read(self) -> bytes:
        self.complete = True
        body, self._body = self._body, b""
        return body

    def close(self) -> None:
        self._body = b""


class Follow:
    """A job's events after a sequence number, then live until it ends; works from any instance."""

    __slots__ = ("_after", "_background", "_closed", "_ended", "_job", "acquire_ms", "complete", "headers", "status")

    def __init__(self, background: Background, job: Job, after: int) -> None:
        self._background = background
        self._job = job
        self._after = after
        self._closed = False
        self._ended = False
        self.status = 200
        self.headers = [(b"content-type", SSE)]
        self.complete = False
        self.acquire_ms = 0.0

    async def next_chunk(self) -> bytes:
        jobs = self._background.jobs
        ident = self._job.ident
        checked = time.monotonic()
        while not self._closed:
            try:
                found = await jobs.events(ident, self._after)
                if found:
                    self._after = found[-1][0]
                    return b"".join(self._frame(seq, data) for seq, data in found)
                if self._ended:
                    self.complete = True
                    return b""
                job = await jobs.get(ident)
                if job is None or job.status in TERMINAL:
                    if not await jobs.events(ident, self._after):  # nothing came between the two reads
                        self._ended = True
                        return self._ending(job)
                    continue
                if time.monotonic() - checked > 1.0:
                    checked = time.monotonic()
                    await self._background.check_owner(job)
                await jobs.changed(ident, 1.0)
            except StoreUnavailable as exc:
                raise PoolError(f"background store unavailable: {exc}") from None
        raise PoolError("closed")

    def _frame(self, seq: int, data: bytes) -> bytes:
        if self._job.kind == "responses":
            return data  # stored as the upstream sent it: `event:` and `data:` lines
        return b"id: %d\n" % seq + data

    def _ending(self, job: Job | None) -> bytes:
        """What a client needs after the last stored event: the end of the stream in its dialect."""
        status = job.status if job is not None else "failed"
        if self._job.kind == "responses":
            if job is not None:
                return b""  # its terminal event, written with its end, is the last one stored
            response = {"id": self._job.ident, "status": "failed"}  # gone (expired, or the store emptied)
            event = {"type": "response.failed", "sequence_number": self._after + 1, "response": response}
            return b"event: response.failed\ndata: " + orjson.dumps(event) + b"\n\n"
        if status == "completed":
            return b"data: [DONE]\n\n"
        document = orjson.loads(job.object) if job is not None else {}
        error = errors.UpstreamError(str((document.get("error") or {}).get("message", "the job failed")))
        error.code = (document.get("error") or {}).get("code", "background_failed")
        return error.sse_event()

    async def read(self) -> bytes:
        parts = []
        while chunk := await self.next_chunk():
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        self._closed = True


@dataclass(slots=True)
class Running:
    """A job this process runs: its task, and why it was told to stop (None: it was not)."""

    job: Job
    started: float  # time.monotonic()
    task: asyncio.Task[None] | None = None
    reason: str | None = None  # "ended" (its record says so), "lost" (our lease lapsed), "shutdown"
    finishing: bool = False  # writing its end: a lapse of the lease no longer changes it


class Background:
    """The jobs this process runs, and the access to everyone's jobs."""

    def __init__(self, settings: Settings, upstreams: Upstreams, store: Store | None) -> None:
        spec = self.spec = settings.background
        self.upstreams = upstreams
        self.jobs: Jobs = (
            RedisJobs(store, spec.ttl_s, spec.max_events, spec.lease_s)
            if store is not None
            else MemoryJobs(spec.ttl_s, spec.max_events)
        )
        self.bounds = Bounds(spec.buffer_events, spec.buffer_bytes, spec.store_wait_s, spec.ttl_s)
        self.shared = store is not None
        self.instance = f"{random.getrandbits(64):016x}"
        self.running: dict[str, Running] = {}
        self.renewed_at: float | None = None  # time.monotonic() when the last renewal that succeeded was sent
        self._lease: asyncio.Task[None] | None = None
        # Signed events for the jobs that end (webhooks.py): added by whoever ends a job, sent by any instance.
        # A job's watch is looked at once its owner's lease would have run out twice over.
        own = {name: tenant.webhook for name, tenant in settings.tenants.items() if tenant.webhook is not None}
        hooks = None
        if spec.webhook is not None or own:
            hooks = Webhooks(spec.webhook, own, store, self._settle, 2 * spec.lease_s)
        self.webhooks = hooks
        self._notices: set[asyncio.Task[None]] = set()

    def _ended(self, job: Job, status: str) -> None:
        """A job ended here: its webhook is stored in a task of its own (it retries while the store is away)."""
        if self.webhooks is not None:
            self._notice(self.webhooks.ended(job, status))

    def _notice(self, write: Coroutine[Any, Any, None]) -> None:
        notice = asyncio.get_running_loop().create_task(write)
        self._notices.add(notice)
        notice.add_done_callback(self._notices.discard)

    async def _settle(self, ident: str) -> Job | None:
        """A job as it stands, marked failed first if its owner is gone (None: its record is gone)."""
        job = await self.jobs.get(ident)
        return None if job is None else await self.check_owner(job)

    async def start(self) -> None:
        if self.webhooks is not None:
            await self.webhooks.start()
        if self.shared:
            with contextlib.suppress(StoreUnavailable):
                await self.jobs.prepare()
            with contextlib.suppress(StoreUnavailable):
                await self._renew()
            self._lease = asyncio.get_running_loop().create_task(self._keep_lease())

    async def _keep_lease(self) -> None:
        """Renew this instance's lease every lease_s / 3, retried soon after a failure (the breaker lets it by)."""
        every = self.spec.lease_s / 3
        wait = every
        while True:
            await asyncio.sleep(wait)
            try:
                await self._renew()
                if wait != every:
                    log.warning("background: the lease of instance %s is renewed again", self.instance)
                wait = every
            except StoreUnavailable as exc:
                if wait == every:
                    log.warning("background: cannot renew the lease of instance %s (%s)", self.instance, exc)
                wait = min(RETRY_S, every)

    async def _renew(self) -> None:
        """One renewal: the lease and our jobs' slots; stop the jobs that ended elsewhere or that the lease lost."""
        sent = time.monotonic()
        running = list(self.running.values())
        renewal = await self.jobs.renew(self.instance, [r.job for r in running])
        if renewal.lapsed and self.renewed_at is not None:
            # Our lease ran out (this process was paused, or the store was away, longer than lease_s): every
            # other instance may take the jobs it covered for dead, so they are. A job started since is not.
            lapsed_at = self.renewed_at + self.spec.lease_s
            for entry in running:
                if entry.started < lapsed_at and not entry.finishing:
                    log.warning("background job %s: the lease of instance %s lapsed", entry.job.ident, self.instance)
                    self._stop(entry, "lost")
        self.renewed_at = sent
        for entry in running:
            if entry.job.ident in renewal.ended:
                self._stop(entry, "ended")  # cancelled, or failed by another instance: its task says so
            elif entry.job.ident in renewal.lost and not entry.finishing:
                log.warning("background job %s: its slot had run out", entry.job.ident)
                self._stop(entry, "lost")

    def _stop(self, entry: Running, reason: str) -> None:
        if entry.reason is None:
            entry.reason = reason
        # A job writing its end keeps at it, except at shutdown: then what it could not write now is lost
        # with the process, and its lease's expiry makes it `owner_lost` for the other instances.
        task = entry.task
        if task is not None and not task.cancelling() and (not entry.finishing or reason == "shutdown"):
            task.cancel()

    # Starting

    async def begin(self, ex: Exchange, chain: tuple[Target, ...]) -> tuple[str, UpstreamResponse]:
        """Record the job, start it, and answer the request that made it: (the job's id, the answer)."""
        kind = ex.endpoint
        prefix = "resp_" if kind == "responses" else "bgjob_"
        ident = prefix + f"{random.getrandbits(192):048x}"
        now = int(time.time())
        if kind == "responses":
            document = queued_response(ident, ex.json, now)
            given = ex.json.get("input")
            items = input_items(ident, given)
        else:
            document = {"id": ident, "object": "sluice.background", "created_at": now, "model": ex.model,
                        "status": "queued", "result": None, "error": None}  # fmt: skip
            items = []
        job = Job(
            ident, kind, ex.tenant, ex.model, self.instance, "queued", orjson.dumps(document), orjson.dumps(items)
        )
        try:
            admitted = await self.jobs.create(job, self.spec.max_inflight_per_tenant)
        except StoreUnavailable:
            raise errors.ServiceUnavailableError(
                "background requests need the job store, which is unavailable; retry shortly",
                code="background_unavailable",
            ) from None
        if not admitted:
            raise errors.RateLimitError(
                f"tenant {ex.tenant!r} has {self.spec.max_inflight_per_tenant} background requests in flight",
                type="requests",
                code="background_limit",
                headers=[(b"retry-after", b"1")],
            )
        if self.webhooks is not None:
            await self.webhooks.started(job)
        entry = self.running[ident] = Running(job, time.monotonic())
        entry.task = task = asyncio.get_running_loop().create_task(self._run(entry, ex, chain, document))
        task.add_done_callback(lambda _: self.running.pop(ident, None))
        if kind != "responses":
            location = f"/v1/sluice/background/{ident}".encode()
            return ident, Canned(202, job.object, [(b"location", location)])
        return ident, Follow(self, job, -1) if ex.stream else Canned(200, job.object)

    async def _run(self, entry: Running, origin: Exchange, chain: tuple[Target, ...], document: dict[str, Any]) -> None:
        job = entry.job
        body = {k: v for k, v in origin.json.items() if k != "background"}
        body["stream"] = True
        if job.kind != "responses":
            body["stream_options"] = {"include_usage": True}
        ex = Exchange(origin.request_id, job.kind, origin.headers, orjson.dumps(body), body, time.perf_counter())
        ex.tenant = origin.tenant
        ex.targets = list(chain)
        ex.traceparent = origin.traceparent
        ex.upstream_fields = origin.upstream_fields  # what a plugin adds upstream (its class's priority)
        recorder = Recorder(self.jobs, job, document, self.bounds, lambda: self._stop(entry, "ended"))
        outcome: Outcome | None = None
        wait_s: float | None = None
        try:
            opened = None
            try:
                async with asyncio.timeout(self.spec.max_seconds):
                    opened = await self.upstreams.open(ex)
                    recorder.begin()
                    await recorder.feed(opened.first)
                    while chunk := await opened.response.next_chunk():
                        await recorder.feed(chunk)
            finally:
                if opened is not None:
                    opened.response.close()  # a job that stops for any reason stops its upstream request here
            outcome = recorder.outcome()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # told to stop: what remains is to record why, if anyone has to
            if entry.reason == "ended":
                log.warning(ENDED_ELSEWHERE, job.ident)
            elif entry.reason == "lost":
                outcome = recorder.failure("failed", LOST_ERROR)
            elif entry.reason == "shutdown":
                outcome, wait_s = recorder.failure("failed", SHUTDOWN_ERROR), 0.0
            else:  # not by us: the loop itself is going away, so one try
                outcome, wait_s = recorder.failure("cancelled", {"code": "cancelled", "message": "cancelled"}), 0.0
        except Ended:
            log.warning(ENDED_ELSEWHERE, job.ident)
        except Overflow as exc:
            outcome = recorder.failure("failed", store_error(str(exc)))
            log.warning("background job %s: failed, the store %s", job.ident, exc)
        except TimeoutError:
            message = f"the job ran longer than background.max_seconds ({self.spec.max_seconds:g} s)"
            outcome = recorder.failure("failed", {"code": "timeout", "message": message})
        except errors.GatewayError as exc:
            outcome = recorder.failure("failed", {"code": exc.code or "upstream_error", "message": exc.message})
        except PoolError as exc:  # the stream was cut: its client is told that, the log what cut it
            log.info("background job %s: upstream failed mid-stream (%s: %s)", job.ident, type(exc).__name__, exc)
            message = "upstream failed: the upstream connection was cut"
            outcome = recorder.failure("failed", {"code": "upstream_error", "message": message})
        except Exception:
            log.exception("background job %s failed inside the gateway", job.ident)
            outcome = recorder.failure("failed", {"code": "internal_error", "message": "internal gateway error"})
        recorder.stop()
        if outcome is not None:
            entry.finishing = True
            if await recorder.finish(outcome, wait_s, 0.0 if wait_s is not None else None):
                self._ended(job, outcome.status)
        await _quietly(self.jobs.release(job))

    # Reading

    async def check_owner(self, job: Job) -> Job:
        """`job`, marked failed first if it is unfinished and its owner's lease has expired."""
        if job.status in TERMINAL:
            return job
        if job.owner == self.instance:
            if job.ident in self.running:
                return job
            # Ours, but its task is gone without recording its end (the store failed meanwhile).
        elif await self.jobs.alive(job.owner):
            return job
        failed = failed_document(job, "failed", LOST_ERROR)
        if await self.jobs.finish(job, "failed", failed, _terminal(job)):
            log.warning("background job %s: owner %s lost, marked failed", job.ident, job.owner)
            self._ended(job, "failed")
            await _quietly(self.jobs.release(job))
        return await self.jobs.get(job.ident) or job

    async def cancel(self, job: Job) -> Job:
        if job.status in TERMINAL:
            return job
        cancelled = failed_document(job, "cancelled", None)
        if await self.jobs.finish(job, "cancelled", cancelled, _terminal(job)):
            self._ended(job, "cancelled")
            await _quietly(self.jobs.release(job))
        entry = self.running.get(job.ident)
        if entry is not None:
            self._stop(entry, "ended")  # here: stop it now; elsewhere, its owner's next renewal stops it
        return await self.jobs.get(job.ident) or job

    def follow(self, job: Job, after: int) -> Follow:
        return Follow(self, job, after)

    async def aclose(self) -> None:
        if self._lease is not None:
            self._lease.cancel()
        entries = list(self.running.values())
        for entry in entries:
            self._stop(entry, "shutdown")  # each writes its end (gateway_shutdown) at once, or never
        for entry in entries:
            if entry.task is not None:
                with contextlib.suppress(BaseException):
                    await entry.task
            log.info("background job %s: failed at shutdown", entry.job.ident)
        if self._notices:  # webhooks of the jobs just ended: into the store before this process goes
            await asyncio.wait(list(self._notices), timeout=2.0)
        if self.webhooks is not None:
            await self.webhooks.aclose()


def _terminal(job: Job) -> str:
    return "response.failed" if job.kind == "responses" else ""


async def _quietly(call: Any) -> None:
    """Best effort: the job's record may not be writable (Redis down); the TTL will clean up."""
    with contextlib.suppress(StoreUnavailable):
        await call
