"""Background mode run by the gateway, for backends that do not have it (vLLM, simulated, chat-only).

`POST /v1/responses` with `background: true` (or `POST /v1/chat/completions` with `x-sluice-background:
true`) is admitted by the pipeline as usual (auth, rate limits), then its one target is a `Starter`: it
records the job (`gateway.responses.job_store`), starts a task owned by this process that streams the request from
the model's real targets and stores every event with its sequence number, and answers at once: the queued
response object (or, for `stream: true`, the live stream of its events), or `202 Accepted` with a
`Location` for chat. Polls, resumes and cancels reach the job through a `Reader` target, on any instance.

The task is bounded (`background.max_seconds`, the tenant's `max_inflight_per_tenant`); while it runs, this
instance renews its lease every `lease_s / 3`. A reader that finds a job running on an instance whose lease
has expired marks it failed, so a job never stays in progress after its owner died. On a graceful shutdown
the owner marks its unfinished jobs failed at once (they cannot be finished elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import TYPE_CHECKING, Any

import orjson

from gateway import errors
from gateway.context import Exchange
from gateway.responses.job_recorder import Recorder, failed_document, input_items, queued_response
from gateway.responses.job_store import TERMINAL, Job, Jobs, MemoryJobs, RedisJobs
from gateway.state.store import StoreUnavailable
from gateway.upstream.pool import PoolError

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
            if status in ("completed", "incomplete"):
                return b""  # its terminal event is the last one stored
            response = orjson.loads(job.object) if job is not None else {"id": self._job.ident, "status": "failed"}
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
        self.shared = store is not None
        self.instance = f"{random.getrandbits(64):016x}"
        self.running: dict[str, tuple[asyncio.Task[None], Job]] = {}
        self._lease: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.shared:
            with contextlib.suppress(StoreUnavailable):
                await self.jobs.prepare()
                await self.jobs.renew(self.instance)
            self._lease = asyncio.get_running_loop().create_task(self._keep_lease())

    async def _keep_lease(self) -> None:
        """Renew this instance's lease; stop the jobs that were cancelled elsewhere."""
        while True:
            await asyncio.sleep(self.spec.lease_s / 3)
            try:
                await self.jobs.renew(self.instance)
                for ident in await self.jobs.cancel_requested(list(self.running)):
                    task, _ = self.running.get(ident, (None, None))
                    if task is not None:
                        task.cancel()
            except StoreUnavailable:
                log.warning("background: cannot renew the lease of instance %s", self.instance)

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
            admitted = await self.jobs.create(job, self.spec.max_inflight_per_tenant, self.spec.max_seconds)
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
        task = asyncio.get_running_loop().create_task(self._run(job, ex, chain, document))
        self.running[ident] = (task, job)
        task.add_done_callback(lambda _: self.running.pop(ident, None))
        if kind != "responses":
            location = f"/v1/sluice/background/{ident}".encode()
            return ident, Canned(202, job.object, [(b"location", location)])
        return ident, Follow(self, job, -1) if ex.stream else Canned(200, job.object)

    async def _run(self, job: Job, origin: Exchange, chain: tuple[Target, ...], document: dict[str, Any]) -> None:
        body = {k: v for k, v in origin.json.items() if k != "background"}
        body["stream"] = True
        if job.kind != "responses":
            body["stream_options"] = {"include_usage": True}
        ex = Exchange(origin.request_id, job.kind, origin.headers, orjson.dumps(body), body, time.perf_counter())
        ex.tenant = origin.tenant
        ex.targets = list(chain)
        ex.traceparent = origin.traceparent
        recorder = Recorder(self.jobs, job, document)
        opened = None
        try:
            async with asyncio.timeout(self.spec.max_seconds):
                opened = await self.upstreams.open(ex)
                await recorder.begin()
                await recorder.feed(opened.first)
                while chunk := await opened.response.next_chunk():
                    await recorder.feed(chunk)
            await recorder.end()
        except asyncio.CancelledError:
            await _quietly(recorder.fail("cancelled", {"code": "cancelled", "message": "cancelled by the client"}))
        except TimeoutError:
            message = f"the job ran longer than background.max_seconds ({self.spec.max_seconds:g} s)"
            await _quietly(recorder.fail("failed", {"code": "timeout", "message": message}))
        except errors.GatewayError as exc:
            await _quietly(recorder.fail("failed", {"code": exc.code or "upstream_error", "message": exc.message}))
        except PoolError as exc:
            await _quietly(recorder.fail("failed", {"code": "upstream_error", "message": f"upstream failed: {exc}"}))
        except StoreUnavailable as exc:
            log.warning("background job %s: store unavailable (%s); it cannot be recorded", job.ident, exc)
        except Exception:
            log.exception("background job %s failed inside the gateway", job.ident)
            await _quietly(recorder.fail("failed", {"code": "internal_error", "message": "internal gateway error"}))
        finally:
            recorder.stop()
            if opened is not None:
                opened.response.close()  # a cancelled or failed job stops its upstream request here
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
        if await self.jobs.update(job, "failed", failed):
            log.warning("background job %s: owner %s lost, marked failed", job.ident, job.owner)
            await _quietly(self.jobs.release(job))
        return await self.jobs.get(job.ident) or job

    async def cancel(self, job: Job) -> Job:
        if job.status in TERMINAL:
            return job
        cancelled = failed_document(job, "cancelled", None)
        await self.jobs.update(job, "cancelled", cancelled)
        running = self.running.get(job.ident)
        if running is not None:
            running[0].cancel()  # here: stop it now
        else:
            await self.jobs.request_cancel(job.ident)  # elsewhere: its owner's lease loop stops it
        return await self.jobs.get(job.ident) or job

    def follow(self, job: Job, after: int) -> Follow:
        return Follow(self, job, after)

    async def aclose(self) -> None:
        if self._lease is not None:
            self._lease.cancel()
        for ident, (task, job) in list(self.running.items()):
            await _quietly(self.jobs.update(job, "failed", failed_document(job, "failed", SHUTDOWN_ERROR)))
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            log.info("background job %s: failed at shutdown", ident)


async def _quietly(call: Any) -> None:
    """Best effort: the job's record may not be writable (Redis down); the TTL will clean up."""
    with contextlib.suppress(StoreUnavailable):
        await call
