"""A background job's stream as it arrives, stored; and the documents a job's record holds.

Events are parsed here (off the client's path: nobody waits on this relay) to keep their sequence numbers
and, for Responses, to put the job's id in the response objects they carry. They are written in batches of
up to FLUSH_EVENTS, or FLUSH_S after the first of a batch arrived: one pipelined round trip each.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import orjson

from gateway.state.store import StoreUnavailable
from gateway.wire import completion

if TYPE_CHECKING:
    from gateway.responses.job_store import Job, Jobs

FLUSH_EVENTS = 32  # events stored in one round trip at most...
FLUSH_S = 0.05  # ...and no later than this after the first of them arrived

log = logging.getLogger("sluice.background")


class Recorder:
    """Stores a job's stream as it arrives: events in batches, the status when it changes."""

    def __init__(self, jobs: Jobs, job: Job, document: dict[str, Any]) -> None:
        self.jobs = jobs
        self.job = job
        self.document = document
        self.buffer = b""
        self.pending: list[tuple[int, bytes]] = []
        self.timer: asyncio.TimerHandle | None = None
        self.writes: set[asyncio.Task[None]] = set()
        # Writes in order: a stream's entry ids must grow, so a batch never overtakes the one before it.
        self.lock = asyncio.Lock()
        self.seq = -1
        self.raw: list[bytes] = []  # chat: every event, assembled into the completion at the end
        self.terminal: dict[str, Any] | None = None

    async def begin(self) -> None:
        self.document = {**self.document, "status": "in_progress"}
        await self.jobs.update(self.job, "in_progress", orjson.dumps(self.document))

    async def feed(self, chunk: bytes) -> None:
        self.buffer += chunk
        *events, self.buffer = self.buffer.split(b"\n\n")
        for event in events:
            if event.strip():
                self._take(event + b"\n\n")
        if len(self.pending) >= FLUSH_EVENTS:
            await self.flush()

    def _take(self, event: bytes) -> None:
        if self.job.kind == "responses":
            event = self._responses_event(event)
        else:
            if b"data: [DONE]" in event:
                return
            self.raw.append(event)
            self.seq += 1
        if not self.pending and self.timer is None:
            # Followers see an event within FLUSH_S even if the model then goes quiet for a while.
            self.timer = asyncio.get_running_loop().call_later(FLUSH_S, self._flush_later)
        self.pending.append((self.seq, event))

    def _flush_later(self) -> None:
        self.timer = None
        task = asyncio.get_running_loop().create_task(self._flush_quietly())
        self.writes.add(task)
        task.add_done_callback(self.writes.discard)

    async def _flush_quietly(self) -> None:
        try:
            await self.flush()
        except StoreUnavailable as exc:
            log.warning("background job %s: events not stored (%s)", self.job.ident, exc)

    def _responses_event(self, event: bytes) -> bytes:
        """The event with the job's id in its response object; its sequence number kept."""
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
        if parsed.get("type") in ("response.completed", "response.incomplete", "response.failed"):
            self.terminal = response
        return b"event: " + str(parsed.get("type", "")).encode() + b"\ndata: " + orjson.dumps(parsed) + b"\n\n"

    async def flush(self) -> None:
        async with self.lock:
            pending, self.pending = self.pending, []
            if pending:
                await self.jobs.append(self.job.ident, pending)

    def stop(self) -> None:
        """No more timed writes: the job has ended (its last events are flushed by end or fail)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    async def end(self) -> None:
        await self.flush()
        if self.job.kind == "responses":
            if self.terminal is None:
                await self.fail("failed", {"code": "upstream_error", "message": "the stream ended early"})
                return
            status = str(self.terminal.get("status") or "completed")
            await self.jobs.update(self.job, status, orjson.dumps(self.terminal))
            return
        answer = completion.assemble(self.job.kind, b"".join(self.raw) + b"data: [DONE]\n\n")
        if answer is None:
            await self.fail("failed", {"code": "upstream_error", "message": "the stream ended early"})
            return
        document = {**self.document, "status": "completed", "result": answer}
        await self.jobs.update(self.job, "completed", orjson.dumps(document))

    async def fail(self, status: str, error: dict[str, str]) -> None:
        await self.flush()
        await self.jobs.update(self.job, status, failed_document(self.job, status, error, self.document))


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
