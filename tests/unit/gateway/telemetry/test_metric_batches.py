"""A series' waiting values, once added, show exactly what prometheus_client's own observe() and inc() show."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.settings import TelemetrySettings
from gateway.telemetry.metrics import BATCH, LATENCY_BUCKETS, OVERHEAD_BUCKETS, Metrics, Series

LABELS = ("t", "m", "m", "b", "false")
# Values on, just under and just over bucket bounds, and past the last one.
VALUES = [
    0.0, 0.0001, 0.00010001, 0.0005, 0.00049, 0.002, 0.003, 0.0031, 1.0, 2.56, 81.92, 100.0, 7e-5, math.nan,
]  # fmt: skip


def samples(registry: CollectorRegistry, prefix: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.startswith(prefix) and not sample.name.endswith("_created"):
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k in ("le", "status", "direction")))
                found[(sample.name, labels)] = sample.value
    return found


def test_added_values_match_observe_and_inc() -> None:
    metrics = Metrics(TelemetrySettings())
    assert metrics.batched
    series = metrics.series[LABELS] = Series(metrics, LABELS)  # as record() makes it
    reference = CollectorRegistry()
    names = ("tenant", "model", "served_model", "backend", "stream")
    overhead = Histogram("sluice_overhead_seconds", "", names, buckets=OVERHEAD_BUCKETS, registry=reference)
    duration = Histogram("sluice_request_duration_seconds", "", names, buckets=LATENCY_BUCKETS, registry=reference)
    requests = Counter("sluice_requests_total", "", (*names, "status"), registry=reference)
    tokens = Counter("sluice_tokens_total", "", (*names[:4], "direction"), registry=reference)
    for i, value in enumerate(VALUES):
        series.observe("overhead", value, None)
        series.observe("duration", value * 3, None)
        series.count("200" if i % 3 else "503")
        series.tokens("output", i)
        series.done()
        overhead.labels(*LABELS).observe(value)
        duration.labels(*LABELS).observe(value * 3)
        requests.labels(*LABELS, "200" if i % 3 else "503").inc()
        tokens.labels(*LABELS[:4], "output").inc(i)
    assert ("sluice_overhead_seconds_count", ()) not in samples(metrics.registry, "sluice_overhead")  # waiting
    metrics.refresh()  # what a scrape does first
    for prefix in ("sluice_overhead", "sluice_request_duration", "sluice_requests", "sluice_tokens"):
        got, want = samples(metrics.registry, prefix), samples(reference, prefix)
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == value or (math.isnan(got[key]) and math.isnan(value)), key


def test_a_series_adds_its_values_after_a_batch_of_requests() -> None:
    metrics = Metrics(TelemetrySettings())
    series = Series(metrics, LABELS)
    for _ in range(BATCH):
        series.count("200")
        series.done()
    assert samples(metrics.registry, "sluice_requests")["sluice_requests_total", (("status", "200"),)] == BATCH
    assert series.held == 0
