"""One label tuple's request series: the values of its requests, held as rows and added to Prometheus in batches.

`Metrics.record` appends one row a request; `flush` adds them all to the labelled children, filtering,
converting and bucketing each column in C (metrics.py says when).
"""

from __future__ import annotations

import bisect
from collections import Counter as Tally
from functools import partial
from operator import is_not, lt
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.telemetry.metrics import Metrics

CLIENT_CLOSED = "499"  # the client left before the response head: no status was ever sent
# The histograms a row observes, in its column order: the Metrics attributes of the request series.
HISTOGRAMS = ("duration", "ttft", "tpot", "upstream", "overhead")
# One request's values as record() keeps them: (status, duration, ttft, tpot, upstream, overhead in ms, input
# tokens, output tokens, of the input those read from the provider's prompt cache and those written to it). A
# histogram's None is no observation (overhead: 0 or less is none); token counts are as the usage reported
# them, if at all, and only positive integers count.
Row = tuple[int, float | None, float | None, float | None, float | None, float, Any, Any, Any, Any]
SECONDS = (1000.0).__rtruediv__  # ms -> ms / 1000.0, in C
KEEP = (  # per histogram of HISTOGRAMS: which of a column's values it observes, tested in C
    partial(is_not, None),
    partial(is_not, None),
    partial(is_not, None),
    partial(is_not, None),
    partial(lt, 0),  # 0 < overhead: a head was sent
)


class Series:
    """The labelled children of one (tenant, model, served_model, backend, stream, cache) tuple.

    Children are made on first use, so that a cache hit, say, has no empty upstream or token series. A request's
    values wait here as one tuple (its row), appended by `Metrics.record`, the only per-request work; `flush`
    adds them all to the children, filtering, converting and bucketing each column in C.
    """

    __slots__ = ("children", "labels", "metrics", "rows", "stream")

    def __init__(self, metrics: Metrics, labels: tuple[str, ...]) -> None:
        self.metrics = metrics
        self.labels = labels
        self.children: dict[str | int, Any] = {}  # histogram name, status code or token direction -> child
        self.stream = labels[4] == "true"
        self.rows: list[Row] = []  # one per request whose values wait here

    @property
    def held(self) -> int:
        """Requests whose values wait here."""
        return len(self.rows)

    def observe_traced(self, row: Row, exemplar: dict[str, str]) -> Row:
        """A request with an exemplar (its trace id): its observations put on their buckets with it at once, and
        the rest of its row (status, tokens) returned to wait."""
        status, duration, ttft, tpot, upstream, overhead, *counts = row
        for name, keep, ms in zip(HISTOGRAMS, KEEP, (duration, ttft, tpot, upstream, overhead), strict=True):
            if ms is not None and keep(ms):
                self._child(name).observe(ms / 1000.0, exemplar)
        return (status, None, None, None, None, 0.0, *counts)

    def flush(self) -> None:
        """Every waiting value into the Prometheus children: one lock per histogram sum and bucket, per counter;
        and the requests out of flight."""
        rows = self.rows
        if not rows:
            return
        statuses, *observed, prompts, completions, reads, writes = zip(*rows, strict=True)
        rows.clear()
        for name, keep, column in zip(HISTOGRAMS, KEEP, observed, strict=True):
            values = list(map(SECONDS, filter(keep, column)))
            if values:
                add(self._child(name), values)
        children = self.children
        for status, n in Tally(statuses).items():
            child = children.get(status)
            if child is None:
                label = str(status) if status else CLIENT_CLOSED
                child = children[status] = self.metrics.requests.labels(*self.labels, label)
            child.inc(n)
        for direction, column in (
            ("input", prompts),
            ("output", completions),
            ("cache_read", reads),
            ("cache_write", writes),
        ):
            n = tokens(column)
            if n:
                child = children.get(direction)
                if child is None:
                    child = children[direction] = self.metrics.tokens.labels(*self.labels[:4], direction)
                child.inc(n)
        self.metrics.ended(self.stream, len(statuses))

    def _child(self, name: str) -> Any:
        child = self.children.get(name)
        if child is None:
            child = self.children[name] = getattr(self.metrics, name).labels(*self.labels)
        return child


def add(child: Any, values: list[float]) -> None:
    """Values into a histogram child as its observe() would put them, with its sum once and each bucket's count
    once; the bucket of each value (the first bound at or above it) is found and counted in C."""
    total = sum(values)
    child._sum.inc(total)
    if total != total:  # a NaN among them (or both infinities): observe() puts NaN in no bucket
        values = [value for value in values if value == value]
    buckets = child._buckets  # the last bound is +Inf: every other value has a bucket
    for at, n in Tally(map(partial(bisect.bisect_left, child._upper_bounds), values)).items():
        buckets[at].inc(n)


def prompt_cache(usage: dict[str, Any]) -> tuple[Any, Any]:
    """Of a request's input tokens, those the provider read from its prompt cache and those it wrote to it:
    Anthropic's `cache_read_input_tokens` and `cache_creation_input_tokens`, OpenAI's (and llama.cpp's, vLLM's)
    `prompt_tokens_details.cached_tokens` (which has no written count)."""
    read = usage.get("cache_read_input_tokens")
    if read is None:
        details = usage.get("prompt_tokens_details")
        if details is not None:
            read = details.get("cached_tokens") if type(details) is dict else None
        return read, None
    return read, usage.get("cache_creation_input_tokens")


def tokens(column: tuple[Any, ...]) -> int:
    """The sum of a column's token counts that are positive integers (None, 0 and anything else count none)."""
    counts = list(filter(None, column))
    if not counts:
        return 0
    if set(map(type, counts)) == {int} and min(counts) > 0:  # as upstreams report them: summed in C
        return sum(counts)
    return sum(n for n in counts if isinstance(n, int) and n > 0)
