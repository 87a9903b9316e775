"""A flight's answer replayed to a request that follows it: the leader's stream from its start, then live.

An async generator, which mypyc does not compile: apart from the flight (flight.py), which the leader's every
chunk passes through and which is compiled, so that this module alone stays interpreted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from gateway.errors import UpstreamError
from plugins.cache.flight import Flight


async def follow(flight: Flight) -> AsyncIterator[bytes]:
    """The leader's stream from its start, then live; an error event if it breaks off."""
    sent = 0
    while True:
        while sent < len(flight.chunks):
            yield flight.chunks[sent]
            sent += 1
        if flight.done:
            if flight.failed:
                yield UpstreamError("the shared upstream answer broke off").sse_event()
            return
        await asyncio.shield(flight.waiter())
