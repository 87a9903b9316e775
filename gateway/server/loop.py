"""The event loop running in this thread, held rather than asked for on every request.

CPython 3.11's `asyncio.get_running_loop()` and `get_event_loop()` (and so `current_task()` without a loop) make a
`getpid` system call each time, to tell a forked child from its parent. A request asked for its loop three times
(the connection's protocol, its task, the pipeline), each a system call. Here the loop is asked for once a
thread and held; a loop held that no longer runs (a test's next `asyncio.run` in the same thread) is asked for
again, and a forked child forgets the parent's.
"""

from __future__ import annotations

import asyncio
import os
import threading


class Held(threading.local):
    loop: asyncio.AbstractEventLoop | None = None


HELD = Held()


def running_loop() -> asyncio.AbstractEventLoop:
    """The loop running in this thread: RuntimeError where none runs, as from `asyncio.get_running_loop()`."""
    loop = HELD.loop
    if loop is None or not loop.is_running():
        loop = HELD.loop = asyncio.get_running_loop()
    return loop


def _forget() -> None:
    HELD.loop = None


os.register_at_fork(after_in_child=_forget)
