"""When the garbage collector scans everything: the young generations as Python runs them, the oldest when quiet.

CPython collects its oldest generation whenever the objects that survived into it have grown by a quarter
since its last full collection, and a full collection scans every object the process holds. A stream holds
its objects for its whole life (tens of seconds), so while streams open they all survive into the oldest
generation and set off full collections one after another, each longer than the last. Measured with 10,000
streams through one worker (`sluice bench --scenario streams`): fifteen full collections in 20 s, the last
ones 0.8 to 1.5 s each, during which no stream moved (the TTFT the gateway added was about a second at p99),
about half of the gateway's CPU in all, and not one of them found garbage: the request path makes no
reference cycles, so reference counting frees what it leaves. With this schedule the same benchmark's TTFT
added p99 is 2 to 4 ms and the gateway's CPU fell by a quarter (16 s to 12 s).

So: the objects made at start-up (modules, config, plugins) are frozen out of every collection (gc.freeze),
the young generations are collected as Python does, the youngest after YOUNG new objects rather than 700, and
the oldest one only here: when nothing is in flight (checked every CHECK_S), or else once FULL_EVERY_S has
passed, which bounds the cyclic garbage an error path may leave. A full collection that took long is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable

log = logging.getLogger("sluice")

CHECK_S = 30.0
FULL_EVERY_S = 600.0
NEVER = 2**31 - 1  # gen1 collections before CPython would consider a full one itself
# Net new container objects before the youngest generation is collected (CPython's default 700). A request in
# flight holds a few hundred for a moment, so at 700 the requests of a busy process set off collections that
# find nothing but live objects and promote them, to be traversed again by the next generation's; at 10,000 those
# collections are rare, and one costs at most about 0.3 ms (10,000 live objects traversed; 100,000 would save
# more instructions but pause 5 ms). Instructions a request (pure build, 1,000 requests a window): bare 309.5k ->
# 305.1k, full 616k -> 606k.
YOUNG = 10_000
SLOW_S = 0.05


class Collector:
    def __init__(self, busy: Callable[[], int]) -> None:
        self.busy = busy  # requests in flight, and the work after them
        self.saved: tuple[int, int, int] | None = None
        self.last = time.monotonic()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """After start-up: what exists now is kept for the process's life, so no collection need scan it."""
        gc.collect()  # start-up's garbage first, so that none is frozen with the rest
        gc.freeze()
        self.saved = gc.get_threshold()
        gc.set_threshold(max(self.saved[0], YOUNG), self.saved[1], NEVER)
        self.last = time.monotonic()
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(CHECK_S)
            if self.busy() == 0 or time.monotonic() - self.last >= FULL_EVERY_S:
                self.collect()

    def collect(self) -> int:
        """A full collection now; how many objects it freed."""
        started = time.perf_counter()
        busy = self.busy()
        freed = gc.collect()
        self.last = time.monotonic()
        took = time.perf_counter() - started
        if took >= SLOW_S:
            log.info("gc: a full collection took %.0f ms with %d request(s) in flight, freed %d object(s)",
                     took * 1000.0, busy, freed)  # fmt: skip
        return freed

    def close(self) -> None:
        """Python's own schedule back, the frozen objects with it (a process may build another runtime)."""
        if self.task is not None:
            self.task.cancel()
            self.task = None
        if self.saved is not None:
            gc.set_threshold(*self.saved)
            self.saved = None
            with contextlib.suppress(Exception):
                gc.unfreeze()
