"""The in-process backend (`type: simulated`): scripted answers from `gateway.simulation`, no network.

It lets the quickstart, the demo and the tests run the whole pipeline with realistic timing and nothing
else running. The response plays the script on the event loop: the head at once (as a real server sends its
headers before the first token), each piece when it is due.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, ClassVar

from gateway.health import Health
from gateway.pool import ResponseClosed, read_all
from gateway.simulation import Profile, Reply, simulate

if TYPE_CHECKING:
    from gateway.context import Exchange, Target


class SimulatedResponse:
    """One scripted answer; piece i is returned no sooner than `ttft_s + i * tpot_s` after it was made."""

    __slots__ = (
        "_closed",
        "_index",
        "_loop",
        "_reply",
        "_start",
        "_waiter",
        "acquire_ms",
        "complete",
        "headers",
        "status",
    )

    def __init__(self, reply: Reply, request_id: str) -> None:
        self._reply = reply
        self._loop = asyncio.get_running_loop()
        self._start = self._loop.time()
        self._index = 0
        self._closed = False
        self._waiter: asyncio.Future[None] | None = None
        self.status = reply.status
        self.headers = [(b"content-type", reply.content_type), (b"x-request-id", request_id.encode("latin-1"))]
        self.complete = False
        self.acquire_ms = 0.0  # no connection to get

    async def next_chunk(self) -> bytes:
        """The next piece once it is due, b"" after the last one."""
        if self._closed:
            raise ResponseClosed("response closed")
        reply = self._reply
        if self._index >= len(reply.pieces):
            return b""
        delay = self._start + reply.ttft_s + self._index * reply.tpot_s - self._loop.time()
        if delay > 0:
            await self._sleep(delay)
            if self._closed:
                raise ResponseClosed("response closed")
        piece = reply.pieces[self._index]
        self._index += 1
        self.complete = self._index == len(reply.pieces)
        return piece

    async def read(self) -> bytes:
        """The whole body."""
        return await read_all(self.next_chunk)

    def close(self) -> None:
        """Stop: a reader waiting for the next piece wakes up and gets ResponseClosed."""
        self._closed = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _sleep(self, delay: float) -> None:
        # A future rather than asyncio.sleep, so that close() from another task wakes the reader.
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(delay, _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class SimulatedProvider:
    kind: ClassVar[str] = "simulated"
    system: ClassVar[str] = "openai"
    reports_usage = True

    def __init__(self, profile: Profile, name: str = "simulated") -> None:
        self.profile = profile
        self.health = Health(name)

    async def start(self) -> None:
        self.health.mark_up()  # in-process: nothing to connect to

    @property
    def ready(self) -> bool:
        return True

    async def send(self, ex: Exchange, target: Target) -> SimulatedResponse:
        """Script the answer; the head is ready at once, the pieces come from `next_chunk()` when due."""
        # Streams report usage as an upstream asked for it does: the relay hides it if the client did not ask.
        reply = simulate(ex.endpoint, ex.json, target.upstream_model, self.profile, usage=True)
        return SimulatedResponse(reply, ex.request_id)

    async def aclose(self) -> None:
        return None
