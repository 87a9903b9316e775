"""The garbage collector's schedule: the oldest generation only when the gateway runs it, and Python's back after."""

from __future__ import annotations

import gc
import weakref

from gateway.server.collector import NEVER, YOUNG, Collector


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


async def test_full_collections_are_the_collectors_and_python_gets_its_schedule_back() -> None:
    before = gc.get_threshold()
    busy = [3]
    collector = Collector(lambda: busy[0])
    collector.start()
    try:
        # The youngest generation after YOUNG new objects (not Python's 700), the next as Python runs it.
        assert gc.get_threshold() == (max(before[0], YOUNG), before[1], NEVER)
        assert gc.get_freeze_count() > 0  # what start-up made is out of every scan
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle only a collection frees
        gone = weakref.ref(a)
        gc.collect(1)  # still held: it survives the young generations into the oldest
        del a, b
        for _ in range(3):
            gc.collect(1)  # the young ones, as Python runs them: they do not reach it
        assert gone() is not None
        assert collector.collect() >= 2
        assert gone() is None
    finally:
        collector.close()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
