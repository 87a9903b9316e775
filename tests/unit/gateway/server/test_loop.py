"""The loop held per thread (gateway/server/loop.py): always the loop that runs, never a stale one."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from gateway.server.loop import HELD, running_loop


async def held() -> asyncio.AbstractEventLoop:
    assert running_loop() is running_loop()
    return running_loop()


def test_each_runs_loop_is_the_one_held() -> None:
    first_loop = asyncio.new_event_loop()
    first = first_loop.run_until_complete(held())
    assert first is first_loop
    assert HELD.loop is first_loop
    second_loop = asyncio.new_event_loop()  # the first one not closed: it no longer runs, though
    assert second_loop.run_until_complete(held()) is second_loop
    first_loop.close()
    second_loop.close()


def test_each_thread_holds_its_own() -> None:
    found: list[asyncio.AbstractEventLoop] = []
    main = asyncio.new_event_loop()

    async def other_thread_while_this_runs() -> None:
        thread = threading.Thread(target=lambda: found.append(asyncio.run(held())))
        thread.start()
        await asyncio.to_thread(thread.join)
        found.append(running_loop())

    main.run_until_complete(other_thread_while_this_runs())
    main.close()
    assert found[0] is not main
    assert found[1] is main


def test_outside_a_loop_it_is_an_error_as_asyncios() -> None:
    HELD.loop = None
    with pytest.raises(RuntimeError):
        running_loop()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_forgets_the_parents_loop() -> None:
    async def fork() -> int:
        assert running_loop() is HELD.loop
        pid = os.fork()
        if pid == 0:  # the child: the parent's loop is not its own
            os._exit(0 if HELD.loop is None else 1)
        return pid

    pid = asyncio.run(fork())
    assert os.waitpid(pid, 0)[1] == 0
