"""A background job's stream as it arrives, stored; and the documents a job's record holds.

Events are parsed here (off the client's path: nobody waits on this relay) to keep their sequence numbers
and, for Responses, to put the job's id in the response objects they carry. They are written in batches of
up to FLUSH_EVENTS, or FLUSH_S after the first of a batch arrived: one round trip each.

Events the store cannot take (Redis slow, stopped, or the breaker open) stay here, in order, and are written
when it answers again; a retry skips what a timed-out write had stored after all. What waits is bounded
(`background.buffer_events`, `buffer_bytes`): past the bound the job stops and fails, and a job whose
upstream has ended waits at most `background.store_wait_s` for the store before it fails. Either way it
fails visibly: its stream ends with the events kept and then one `response.failed` whose error names the
store, written as soon as the store takes it. Never a silent gap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from gateway.state.store import StoreUnavailable
from gateway.wire import completion

if TYPE_CHECKING:
    from gateway.jobs.store import Job, Jobs

FLUSH_EVENTS = 32  # events stored in one round trip when the store keeps up...
FLUSH_S = 0.05  # ...and no later than this after the first of them arrived
BATCH_EVENTS = 256  # at most this many, and BATCH_BYTES, per write when catching up after an outage:
BATCH_BYTES = 256 * 1024  # each write must fit well within the store's 50 ms deadline
RETRY_S = 0.1  # while the store cannot take events, tried again this often (the breaker fails it at once)
TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})

log = logging.getLogger("sluice.background")


class Ended(Exception):
    """The job's record has ended (a cancel, an instance that took its owner for dead) or is gone: stop."""


class Overflow(Exception):
    """More events have waited for the store than the bound allows."""


@dataclass(frozen=True, slots=True)
class Bounds:
    events: int  # events kept while the store cannot take them...
    bytes: int  # ...and their size
    wait_s: float  # how long a job that has ended upstream waits for the store before it fails
    keep_s: float  # how long a failure not yet written is retried (the record's TTL: it is gone after that)


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a job ends: its status, its final object, the type of its terminal event ('' for chat jobs)."""

    status: str
    object: bytes
    terminal: str


def store_error(message: str) -> dict[str, str]:
    return {"code": "store_unavailable", "message": f"the background job store (redis) {message}"}


class Recorder:
    """Stores a job's stream as it arrives: events in batches, kept while the store is away, then its end."""

    def __init__(
        self, jobs: Jobs, job: Job, document: dict[str, Any], bounds: Bounds, ended: Callable[[], None]
    ) -> None:
        self.jobs = jobs
        self.job = job
        self.document = document
        self.bounds = bounds
        self.ended = ended  # called when a timed write finds the job ended: the job's task stops
        self.buffer = b""
        self.pending: deque[tuple[int, bytes]] = deque()  # not stored yet, in order
        self.pending_bytes = 0
        self.progress: bytes | None = None  # the in_progress object, written with the next events
        self.timer: asyncio.TimerHandle | None = None
        self.writes: set[asyncio.Task[None]] = set()
        # Writes in order: a stream's entry ids must grow, so a batch never overtakes the one before it.
        self.lock = asyncio.Lock()
        self.seq = -1
        self.raw: list[bytes] = []  # chat: every event, assembled into the completion at the end
        self.terminal: dict[str, Any] | None = None  # Responses: the response of the upstream's terminal event
        self.terminal_type = ""
        self.away_since: float | None = None  # when the store last failed to take events, if it has not since
        self.closed = False  # the job is ending: finish writes what is left, no timer does

    def begin(self) -> None:
        self.document = {**self.document, "status": "in_progress"}
        self.progress = orjson.dumps(self.document)

    async def feed(self, chunk: bytes) -> None:
        self.buffer += chunk
        *events, self.buffer = self.buffer.split(b"\n\n")
        for event in events:
            if event.strip():
                self._take(event + b"\n\n")
        if self.away_since is None and (self.progress is not None or len(self.pending) >= FLUSH_EVENTS):
            await self.flush()  # while the store is away, the retry timer writes: no wait per chunk

    def _take(self, event: bytes) -> None:
        if self.job.kind == "responses":
            taken = self._responses_event(event)
            if taken is None:
                return  # the terminal event: written with the job's end, in the same script
            event = taken
        else:
            if b"data: [DONE]" in event:
                return
            self.raw.append(event)
            self.seq += 1
        bounds = self.bounds
        if len(self.pending) >= bounds.events or self.pending_bytes + len(event) > bounds.bytes:
            raise Overflow(
                f"could not take the job's events: more than background.buffer_events ({bounds.events}) or "
                f"buffer_bytes ({bounds.bytes}) waited for it"
            )
        self.pending.append((self.seq, event))
        self.pending_bytes += len(event)
        # Followers see an event within FLUSH_S even if the model then goes quiet for a while.
        self._schedule(FLUSH_S)

    def _schedule(self, delay: float) -> None:
        if self.timer is None and not self.closed:
            self.timer = asyncio.get_running_loop().call_later(delay, self._flush_later)

    def _flush_later(self) -> None:
        self.timer = None
        task = asyncio.get_running_loop().create_task(self._flush_quietly())
        self.writes.add(task)
        task.add_done_callback(self.writes.discard)

    async def _flush_quietly(self) -> None:
        try:
            await self.flush()
        except Ended:
            self.ended()

    def _responses_event(self, event: bytes) -> bytes | None:
        """The event with the job's id in its response object; its sequence number kept. None: terminal."""
        data = next((line[5:] for line in event.split(b"\n") if line.startswith(b"data:")), b"")
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.seq += 1
            return event
        seq = parsed.get("sequence_number")
        self.seq = seq if isinstance(seq, int) and seq > self.seq else self.seq + 1
        response = parsed.get("response")
        if not isinstance(response, dict):
            return event
        parsed["response"] = response = {**response, "id": self.job.ident, "background": True}
        kind = str(parsed.get("type", ""))
        if kind in TERMINAL_EVENTS:
            self.terminal, self.terminal_type = response, kind
            return None
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(parsed) + b"\n\n"

    async def flush(self) -> None:
        """Store what waits; kept (and retried) if the store cannot take it. Ended: the job has ended."""
        try:
            await self._drain()
        except StoreUnavailable as exc:
            if self.away_since is None:
                self.away_since = time.monotonic()
                log.warning(
                    "background job %s: %d event(s) kept until the store takes them (%s)",
                    self.job.ident,
                    len(self.pending),
                    exc,
                )
            self._schedule(RETRY_S)

    async def _drain(self) -> None:
        async with self.lock:
            pending = self.pending
            while pending or self.progress is not None:
                batch: list[tuple[int, bytes]] = []
                size = 0
                for event in pending:
                    if batch and (len(batch) >= BATCH_EVENTS or size + len(event[1]) > BATCH_BYTES):
                        break
                    batch.append(event)
                    size += len(event[1])
                if not await self.jobs.append(self.job, batch, self.progress):
                    raise Ended
                for _ in batch:
                    pending.popleft()
                self.pending_bytes -= size
                self.progress = None
                if self.away_since is not None and not pending:
                    log.warning(
                        "background job %s: the store took the events kept for %.2f s",
                        self.job.ident,
                        time.monotonic() - self.away_since,
                    )
                    self.away_since = None

    def stop(self) -> None:
        """No more timed writes: the job is ending (its last events are written by finish)."""
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def outcome(self) -> Outcome:
        """How the job ends, from the stream it got."""
        if self.job.kind == "responses":
            if self.terminal is None:
                return self.failure("failed", {"code": "upstream_error", "message": "the stream ended early"})
            status = str(self.terminal.get("status") or "completed")
            return Outcome(status, orjson.dumps(self.terminal), self.terminal_type)
        answer = completion.assemble(self.job.kind, b"".join(self.raw) + b"data: [DONE]\n\n")
        if answer is None:
            return self.failure("failed", {"code": "upstream_error", "message": "the stream ended early"})
        return Outcome("completed", orjson.dumps({**self.document, "status": "completed", "result": answer}), "")

    def failure(self, status: str, error: dict[str, str]) -> Outcome:
        terminal = "response.failed" if self.job.kind == "responses" else ""
        return Outcome(status, failed_document(self.job, status, error, self.document), terminal)

    async def finish(self, outcome: Outcome, wait_s: float | None = None, keep_s: float | None = None) -> bool:
        """Write the events kept, then the end, once; whether this call ended the job.

        While the store cannot take them, tried again every RETRY_S: for `wait_s` with `outcome`, then as a
        failure naming the store for up to `keep_s` more (the record's TTL: after that there is nothing left
        to correct). False: the job had ended already (then nothing of this is written), or never written.
        """
        self.stop()
        wait = self.bounds.wait_s if wait_s is None else wait_s
        keep = self.bounds.keep_s if keep_s is None else keep_s
        started = time.monotonic()
        while True:
            try:
                await self._drain()
                async with self.lock:
                    return await self.jobs.finish(self.job, outcome.status, outcome.object, outcome.terminal)
            except Ended:
                return False
            except StoreUnavailable as exc:
                waited = time.monotonic() - started
                if waited >= wait and outcome.status in ("completed", "incomplete"):
                    message = f"did not answer for {wait:g} s (background.store_wait_s) at the job's end"
                    outcome = self.failure("failed", store_error(message))
                    log.warning("background job %s: failed, %s (%s)", self.job.ident, message, exc)
                if waited >= wait + keep:
                    log.error("background job %s: its end could not be stored (%s)", self.job.ident, exc)
                    return False
            await asyncio.sleep(RETRY_S)


def failed_document(job: Job, status: str, error: dict[str, str] | None, base: dict[str, Any] | None = None) -> bytes:
    document = base if base is not None else orjson.loads(job.object)
    return orjson.dumps({**document, "status": status, "error": error})


def queued_response(ident: str, body: dict[str, Any], now: int) -> dict[str, Any]:
    """The response object of a job not yet started, from what the request asked for."""
    return {
        "id": ident,
        "object": "response",
        "created_at": now,
        "status": "queued",
        "background": True,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "model": body.get("model"),
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "store": True,
        "temperature": body.get("temperature"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "truncation": body.get("truncation", "disabled"),
        "usage": None,
        "user": body.get("user"),
    }


def input_items(ident: str, given: Any) -> list[Any]:
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": given}]}]
    if not isinstance(given, list):
        return []
    return [{"id": f"msg_{ident[5:]}_{i}", **item} if isinstance(item, dict) else item for i, item in enumerate(given)]
