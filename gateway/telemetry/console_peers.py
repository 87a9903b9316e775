"""The console across the workers of `sluice serve --workers N`: every worker's recent requests in one view.

Each worker keeps its own ring (telemetry/console.py). The console's JSON is answered by whichever worker the
kernel hands the poll to; that worker asks every other live worker, over a Unix socket each listens on in the
metrics directory the workers share (`console-PID.sock`, beside the metrics' `flush-PID.sock`), for the entries
the view needs (those matching the page's filters, one request id, or those of the last minutes without their
stages), and merges them with its own. So a view is as fresh as the moment it was asked: nothing is copied
ahead of time and nothing is stale, except a worker that does not answer within ASK_TIMEOUT_S, whose requests
are then missing from that one answer. Nothing of this runs unless the console is polled.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from gateway.telemetry.console import ATTEMPTS, RID, ROUTED, TIMINGS, Entry, Ring, Snapshot, T, entries, matches
from gateway.telemetry.metric_files import forget

log = logging.getLogger("sluice.telemetry")

ASK_TIMEOUT_S = 1.0
MAX_QUERY = 4096  # bytes of one question; an answer is as long as its entries


def select(snapshot: Snapshot, question: Mapping[str, Any]) -> list[Entry]:
    """A snapshot's entries for a question: {"view": "requests", "filters": {...}, "limit": n},
    {"view": "request", "id": "..."} or {"view": "window", "since": wall time}. Run in a thread: it may read
    every kept request."""
    view = question.get("view")
    found: list[Entry] = []
    if view == "requests":
        filters = question.get("filters") or {}
        limit = int(question.get("limit") or 0)
        for entry in entries(snapshot, newest_first=True):
            if matches(entry, filters):
                found.append(entry)
                if len(found) >= limit:
                    break
    elif view == "request":
        rid = question.get("id")
        for entry in entries(snapshot, newest_first=True):
            if entry[RID] == rid:
                found.append(entry)
                break
    elif view == "window":
        since = float(question.get("since") or 0.0)
        # The stages, tries and endpoint are not needed for percentiles and shares: left out of what is sent.
        # Records are kept in the order requests ended: the window is the newest ones.
        for e in entries(snapshot, newest_first=True):
            if e[T] < since:
                break
            found.append((*e[:TIMINGS], None, None, *e[ATTEMPTS + 1 : ROUTED], None, *e[ROUTED + 1 :]))
    return found


def answer(snapshot: Snapshot, question: Mapping[str, Any]) -> bytes:
    return orjson.dumps(select(snapshot, question))


class Peers:
    """One worker's side: the socket others ask on, and the asking."""

    def __init__(self, ring: Ring, directory: str) -> None:
        self.ring = ring
        self.path = Path(directory)
        self.socket = self.path / f"console-{os.getpid()}.sock"
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        try:
            self.server = await asyncio.start_unix_server(self._asked, path=str(self.socket))
        except OSError as exc:
            log.warning("console: other workers cannot ask this one for its requests (%s)", exc)

    async def gather(self, question: Mapping[str, Any]) -> list[Entry]:
        """This worker's entries and every other live worker's, for `question`."""
        mine = await asyncio.to_thread(select, self.ring.snapshot(), question)
        others = [path for path in self.path.glob("console-*.sock") if path != self.socket]
        if not others:
            return mine
        asked = orjson.dumps(question) + b"\n"
        answers = await asyncio.gather(*(self._ask(path, asked) for path in others))
        return [*mine, *(tuple(entry) for answer in answers for entry in answer)]

    async def _ask(self, path: Path, question: bytes) -> list[list[Any]]:
        try:
            async with asyncio.timeout(ASK_TIMEOUT_S):
                reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 26)
                try:
                    writer.write(question)
                    found: list[list[Any]] = orjson.loads(await reader.read())
                    return found
                finally:
                    writer.close()
        except (ConnectionRefusedError, FileNotFoundError):
            forget(path)  # a worker that died without removing its socket
        except (OSError, TimeoutError, orjson.JSONDecodeError):
            pass  # busy or going away: its requests are missing from this answer
        return []

    async def _asked(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            if 0 < len(line) <= MAX_QUERY:
                snapshot, question = self.ring.snapshot(), orjson.loads(line)
                writer.write(await asyncio.to_thread(answer, snapshot, question))
                await writer.drain()
        except (OSError, orjson.JSONDecodeError, ValueError, TypeError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
            forget(self.socket)
