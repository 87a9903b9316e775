"""One label tuple's request series: each request's values counted into buckets as it ends, added to Prometheus
in batches.

`Metrics.record` hands one request's values to `Series.record`, the only per-request work: each latency found
its bucket (a bisection of the bounds, in C) and counted there in a plain list, with the histogram's sum, the
status and the token counts. `flush` adds those counts to the labelled children, one lock per bucket that
moved (metrics.py says when).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from typing import TYPE_CHECKING, Any

from prometheus_client.samples import Exemplar

if TYPE_CHECKING:
    from gateway.telemetry.metrics import Metrics

CLIENT_CLOSED = "499"  # the client left before the response head: no status was ever sent
# The histograms a request observes, in the order Series.record takes their values: the Metrics attributes of
# the request series.
HISTOGRAMS = ("duration", "ttft", "tpot", "upstream", "overhead")
DIRECTIONS = ("input", "output", "cache_read", "cache_write")  # the token counts, in the order record takes them


class Series:
    """The labelled children of one (tenant, model, served_model, backend, stream, cache) tuple.

    Children are made on first use, so that a cache hit, say, has no empty upstream or token series. What the
    requests recorded since the last flush add up to waits here: per histogram its bucket counts, its sum and
    how many it observed; per status a count; per token direction a sum.
    """

    __slots__ = (
        "bounds",
        "buckets",
        "children",
        "held",
        "labels",
        "marks",
        "metrics",
        "seen",
        "statuses",
        "stream",
        "sums",
        "tokens",
    )

    def __init__(self, metrics: Metrics, labels: tuple[str, ...]) -> None:
        self.metrics = metrics
        self.labels = labels
        self.children: dict[str | int, Any] = {}  # histogram name, status code or token direction -> child
        self.stream = labels[4] == "true"
        # Per histogram, its upper bounds in seconds, the last +Inf, as prometheus_client's observe() walks them.
        self.bounds: tuple[tuple[float, ...], ...] = metrics.bounds
        self.buckets: list[list[int]] = [[0] * len(bounds) for bounds in self.bounds]
        self.sums: list[float] = [0.0] * len(HISTOGRAMS)
        self.seen: list[int] = [0] * len(HISTOGRAMS)
        self.statuses: dict[int, int] = {}
        self.tokens: list[int] = [0] * len(DIRECTIONS)
        self.held = 0  # requests recorded since the last flush
        # Exemplars waiting for their buckets: (histogram index, seconds, the trace's labels, time.time()).
        self.marks: list[tuple[int, float, dict[str, str], float]] = []

    def record(
        self,
        status: int,
        duration_ms: float | None,
        ttft_ms: float | None,
        tpot_ms: float | None,
        upstream_ms: float | None,
        overhead_ms: float,
        counts: tuple[Any, Any, Any, Any],
    ) -> None:
        """One request's values: its latencies in milliseconds (None, and an overhead of 0 or less: no
        observation), its status and its token counts as the usage reported them (only positive integers
        count)."""
        self.held += 1
        statuses = self.statuses
        statuses[status] = statuses.get(status, 0) + 1
        # Written out, one block a histogram: the request path's cheapest form in both builds (a loop over the
        # five, or a method a value, costs the interpreted build more than the batch this replaced).
        seen, sums, buckets, bounds = self.seen, self.sums, self.buckets, self.bounds
        if duration_ms is not None:
            seconds = duration_ms / 1000.0
            seen[0] += 1
            sums[0] += seconds
            if seconds == seconds:  # NaN goes in no bucket, as observe() puts it (its sum becomes NaN)
                buckets[0][bisect_left(bounds[0], seconds)] += 1
        if ttft_ms is not None:
            seconds = ttft_ms / 1000.0
            seen[1] += 1
            sums[1] += seconds
            if seconds == seconds:
                buckets[1][bisect_left(bounds[1], seconds)] += 1
        if tpot_ms is not None:
            seconds = tpot_ms / 1000.0
            seen[2] += 1
            sums[2] += seconds
            if seconds == seconds:
                buckets[2][bisect_left(bounds[2], seconds)] += 1
        if upstream_ms is not None:
            seconds = upstream_ms / 1000.0
            seen[3] += 1
            sums[3] += seconds
            if seconds == seconds:
                buckets[3][bisect_left(bounds[3], seconds)] += 1
        if overhead_ms > 0.0:
            seconds = overhead_ms / 1000.0
            seen[4] += 1
            sums[4] += seconds
            buckets[4][bisect_left(bounds[4], seconds)] += 1  # not NaN: it was greater than 0
        prompts, completions, read, written = counts
        tokens = self.tokens
        if isinstance(prompts, int) and prompts > 0:
            tokens[0] += prompts
        if isinstance(completions, int) and completions > 0:
            tokens[1] += completions
        if isinstance(read, int) and read > 0:
            tokens[2] += read
        if isinstance(written, int) and written > 0:
            tokens[3] += written

    def record_traced(
        self,
        status: int,
        duration_ms: float,
        ttft_ms: float | None,
        tpot_ms: float | None,
        upstream_ms: float | None,
        overhead_ms: float,
        counts: tuple[Any, Any, Any, Any],
        exemplar: dict[str, str],
    ) -> None:
        """A request with an exemplar (its trace id): recorded as any other, and its latencies noted to be set
        as their buckets' exemplars when the series is flushed (the last one a bucket is given wins, as with
        prometheus_client's observe)."""
        self.record(status, duration_ms, ttft_ms, tpot_ms, upstream_ms, overhead_ms, counts)
        latencies = (duration_ms, ttft_ms, tpot_ms, upstream_ms, overhead_ms if overhead_ms > 0.0 else None)
        now = time.time()
        marks = self.marks
        for index, ms in enumerate(latencies):
            if ms is not None and ms == ms:  # NaN is in no bucket, and so the exemplar of none
                marks.append((index, ms / 1000.0, exemplar, now))

    def flush(self) -> None:
        """What the recorded requests add up to into the Prometheus children, one lock per bucket, sum and counter
        that moved; and the requests out of flight."""
        held = self.held
        if not held:
            return
        self.held = 0
        seen = self.seen
        for index, name in enumerate(HISTOGRAMS):
            if seen[index]:
                child = self._child(name)
                child._sum.inc(self.sums[index])
                counted = self.buckets[index]
                targets = child._buckets
                for at, n in enumerate(counted):
                    if n:
                        targets[at].inc(n)
                        counted[at] = 0
                seen[index] = 0
                self.sums[index] = 0.0
        if self.marks:
            last: dict[tuple[int, int], tuple[float, dict[str, str], float]] = {}  # a bucket keeps its last
            for index, seconds, labels, stamp in self.marks:
                last[index, bisect_left(self.bounds[index], seconds)] = (seconds, labels, stamp)
            for (index, bucket), (seconds, labels, stamp) in last.items():
                self._child(HISTOGRAMS[index])._buckets[bucket].set_exemplar(Exemplar(labels, seconds, stamp))
            self.marks.clear()
        children = self.children
        for status, n in self.statuses.items():
            child = children.get(status)
            if child is None:
                label = str(status) if status else CLIENT_CLOSED
                child = children[status] = self.metrics.requests.labels(*self.labels, label)
            child.inc(n)
        self.statuses.clear()
        tokens = self.tokens
        for index, direction in enumerate(DIRECTIONS):
            n = tokens[index]
            if n:
                child = children.get(direction)
                if child is None:
                    child = children[direction] = self.metrics.tokens.labels(*self.labels[:4], direction)
                child.inc(n)
                tokens[index] = 0
        self.metrics.ended(self.stream, held)

    def _child(self, name: str) -> Any:
        child = self.children.get(name)
        if child is None:
            child = self.children[name] = getattr(self.metrics, name).labels(*self.labels)
        return child


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
