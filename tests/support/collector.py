"""What a test's trace receiver keeps, whatever the wire format: spans as they arrive, waited on with a deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

S = TypeVar("S")


class SpanCollector(Generic[S]):
    """Spans posted by the gateway's exporter; `trace_of` and `name_of` read a span of the receiver's format."""

    def __init__(self, trace_of: Callable[[S], str], name_of: Callable[[S], str]) -> None:
        self.spans: list[S] = []
        self.posts = 0
        self.cond = threading.Condition()
        self.trace_of = trace_of
        self.name_of = name_of

    def take(self, spans: Iterable[S]) -> None:
        with self.cond:
            self.spans.extend(spans)
            self.posts += 1
            self.cond.notify_all()

    def wait(self, predicate: Callable[[list[S]], bool], timeout: float = 10.0) -> list[S]:
        with self.cond:
            assert self.cond.wait_for(lambda: predicate(self.spans), timeout), f"spans so far: {self.spans}"
            return list(self.spans)

    def trace(self, trace_id: str, count: int) -> dict[str, S]:
        """The spans of one trace, by name, once `count` have arrived; fails if more arrive just after."""
        self.wait(lambda spans: sum(self.trace_of(span) == trace_id for span in spans) >= count)
        time.sleep(0.2)  # not a wait for a condition: several export rounds, in which no more may come
        spans = [span for span in self.spans if self.trace_of(span) == trace_id]
        named = {self.name_of(span): span for span in spans}
        assert len(spans) == count == len(named), [self.name_of(span) for span in spans]
        return named
