"""A counter bumped once a request, whose increments wait in this process until the metrics are read.

prometheus_client's `Counter.inc` takes a lock and runs a few interpreted checks (about 2k instructions under
callgrind); a request's own series already wait and are added in batches (series.py). A `Tally` does the same
for a plugin's per-request counter: a request adds one to its label tuple's count in a dict, and `flush`, which
the metrics run before every scrape and every write to the shared files, adds each count to its child at once.
Under prometheus_client's own multiprocess mode, whose files are read by the scrape directly, nothing may wait:
there each count goes to its child as it comes.
"""

from __future__ import annotations

from typing import Any


class Tally:
    __slots__ = ("batched", "children", "counter", "waiting")

    def __init__(self, counter: Any, batched: bool) -> None:
        self.counter = counter  # a prometheus_client Counter with labels
        self.batched = batched
        self.waiting: dict[tuple[str, ...], int] = {}
        self.children: dict[tuple[str, ...], Any] = {}  # a labels() lookup costs more than the increment

    def add(self, labels: tuple[str, ...]) -> None:
        """One more for `labels` (the counter's label values, in its order)."""
        if self.batched:
            waiting = self.waiting
            waiting[labels] = waiting.get(labels, 0) + 1
        else:
            self._child(labels).inc()

    def flush(self) -> None:
        waiting = self.waiting
        if waiting:
            for labels, count in waiting.items():
                self._child(labels).inc(count)
            waiting.clear()

    def _child(self, labels: tuple[str, ...]) -> Any:
        child = self.children.get(labels)
        if child is None:
            child = self.children[labels] = self.counter.labels(*labels)
        return child
