"""A series' waiting values, once added, show exactly what prometheus_client's own observe() and inc() show."""

from __future__ import annotations

import math
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.config import parse
from gateway.context import Exchange
from gateway.plugin import Outcome
from gateway.settings import TelemetrySettings
from gateway.telemetry.metrics import BATCH, LATENCY_BUCKETS, OVERHEAD_BUCKETS, TPOT_BUCKETS, Metrics
from gateway.telemetry.tally import Tally
from gateway.upstream.attempts import Upstreams

CONFIG = """
listen: {host: 127.0.0.1, port: 8080}
backends:
  sim: {type: simulated}
models:
  m: {backend: sim}
"""
# Values on, just under and just over bucket bounds, and past the last one.
VALUES = [
    0.0, 0.0001, 0.00010001, 0.0005, 0.00049, 0.002, 0.003, 0.0031, 1.0, 2.56, 81.92, 100.0, 7e-5, math.nan,
]  # fmt: skip
REQUEST_SERIES = (
    "sluice_requests",
    "sluice_tokens",
    "sluice_time",
    "sluice_request_duration",
    "sluice_upstream",
    "sluice_overhead",
)
Key = tuple[str, tuple[tuple[str, str], ...]]


def samples(registry: CollectorRegistry) -> dict[Key, tuple[float, str | None]]:
    """Every request series' sample: its value and the trace id of its exemplar."""
    found = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.startswith(REQUEST_SERIES) and not sample.name.endswith("_created"):
                exemplar = sample.exemplar.labels["trace_id"] if sample.exemplar is not None else None
                found[(sample.name, tuple(sorted(sample.labels.items())))] = (sample.value, exemplar)
    return found


def same(got: dict[Key, tuple[float, str | None]], want: dict[Key, tuple[float, str | None]]) -> None:
    assert got.keys() == want.keys()
    for key, (value, exemplar) in want.items():
        assert got[key][0] == value or (math.isnan(got[key][0]) and math.isnan(value)), key
        assert got[key][1] == exemplar, key


class Reference:
    """The request series as prometheus_client records them one observe() and inc() at a time."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        names = ("tenant", "model", "served_model", "backend", "stream")
        self.ttft = Histogram(
            "sluice_time_to_first_token_seconds", "", names, buckets=LATENCY_BUCKETS, registry=registry
        )
        self.tpot = Histogram(
            "sluice_time_per_output_token_seconds", "", names, buckets=TPOT_BUCKETS, registry=registry
        )
        self.duration = Histogram(
            "sluice_request_duration_seconds", "", names, buckets=LATENCY_BUCKETS, registry=registry
        )
        self.upstream = Histogram(
            "sluice_upstream_duration_seconds", "", names, buckets=LATENCY_BUCKETS, registry=registry
        )
        self.overhead = Histogram("sluice_overhead_seconds", "", names, buckets=OVERHEAD_BUCKETS, registry=registry)
        self.requests = Counter("sluice_requests_total", "", (*names, "status"), registry=registry)
        self.tokens = Counter("sluice_tokens_total", "", (*names[:4], "direction"), registry=registry)

    def record(self, ex: Exchange, outcome: Outcome, trace_id: str | None) -> None:
        labels = (ex.tenant, ex.model, "m" if ex.served else "", "sim" if ex.served else "", str(ex.stream).lower())
        exemplar = {"trace_id": trace_id} if trace_id is not None else None
        self.requests.labels(*labels, str(outcome.status) if outcome.status else "499").inc()
        self.duration.labels(*labels).observe(outcome.total_ms / 1000.0, exemplar)
        if outcome.status < 400 and outcome.ttft_ms is not None:
            self.ttft.labels(*labels).observe(outcome.ttft_ms / 1000.0, exemplar)
        if outcome.status < 400 and outcome.tpot_ms is not None:
            self.tpot.labels(*labels).observe(outcome.tpot_ms / 1000.0, exemplar)
        if ex.attempts:
            self.upstream.labels(*labels).observe(ex.upstream_ms / 1000.0, exemplar)
        if ex.overhead_ms > 0:
            self.overhead.labels(*labels).observe(ex.overhead_ms / 1000.0, exemplar)
        for field, direction in (("prompt_tokens", "input"), ("completion_tokens", "output")):
            tokens = (outcome.usage or {}).get(field)
            if isinstance(tokens, int) and tokens > 0:
                self.tokens.labels(*labels[:4], direction).inc(tokens)


def request(i: int, value: float, upstreams: Upstreams) -> tuple[Exchange, Outcome, str | None]:
    stream = i % 2 == 0
    ex = Exchange("r", "chat/completions", [], b"{}", {"model": "m", "stream": stream}, time.perf_counter())
    ex.tenant = "t"
    if i % 5:
        ex.served = upstreams.targets["m"]
        ex.attempts = [("m", value * 1000.0, 0)]
        ex.upstream_ms = value * 2000.0
    ex.overhead_ms = value * 1000.0
    status = (200, 200, 503, 0)[i % 4]
    # Mostly counts, but whatever an upstream's usage may hold: only positive integers are tokens.
    odd: list[Any] = [None, 0, -3, 2.5, True, "7", 10**20]
    usage = {"prompt_tokens": i, "completion_tokens": i % 3 if i % 4 else odd[i % 7]} if i % 7 else None
    if i % 11 == 3:
        usage = {"prompt_tokens": odd[i % 7]}
    ttft = value * 500.0 if stream else None
    outcome = Outcome(status=status, ttft_ms=ttft, tpot_ms=ttft, total_ms=value * 3000.0, usage=usage)
    return ex, outcome, (f"{i:032x}" if i % 6 == 1 else None)


def test_added_values_match_observe_and_inc() -> None:
    metrics = Metrics(TelemetrySettings())
    assert metrics.batched
    assert metrics.exemplars
    upstreams = Upstreams(parse(CONFIG))
    reference = Reference()
    for i, value in enumerate(VALUES * 5):
        ex, outcome, trace_id = request(i, value, upstreams)
        metrics.begin(ex)
        metrics.record(ex, outcome, outcome.total_ms, trace_id)
        reference.record(ex, outcome, trace_id)
    assert samples(metrics.registry) != samples(reference.registry)  # the values without an exemplar wait
    metrics.refresh()  # what a scrape does first
    same(samples(metrics.registry), samples(reference.registry))


def test_a_series_adds_its_values_after_a_batch_of_requests() -> None:
    metrics = Metrics(TelemetrySettings())
    upstreams = Upstreams(parse(CONFIG))
    reference = Reference()
    for _ in range(BATCH):
        ex, outcome, _ = request(1, 0.002, upstreams)
        metrics.record(ex, outcome, outcome.total_ms, None)
        reference.record(ex, outcome, None)
    same(samples(metrics.registry), samples(reference.registry))
    assert all(series.held == 0 for series in metrics.series.values())


def test_a_tally_waits_for_the_flush_and_adds_its_counts_once() -> None:
    registry = CollectorRegistry()
    tally = Tally(Counter("hits", "Hits.", ("tenant", "result"), registry=registry), batched=True)
    for result in ("hit", "miss", "hit"):
        tally.add(("acme", result))
    assert registry.get_sample_value("hits_total", {"tenant": "acme", "result": "hit"}) is None
    tally.flush()
    tally.flush()  # nothing more waits: nothing added twice
    assert registry.get_sample_value("hits_total", {"tenant": "acme", "result": "hit"}) == 2
    assert registry.get_sample_value("hits_total", {"tenant": "acme", "result": "miss"}) == 1


def test_an_unbatched_tally_counts_at_once() -> None:
    """prometheus_client's own multiprocess mode reads each value from its file as it changes."""
    registry = CollectorRegistry()
    tally = Tally(Counter("hits", "Hits.", ("tenant",), registry=registry), batched=False)
    tally.add(("acme",))
    assert registry.get_sample_value("hits_total", {"tenant": "acme"}) == 1
