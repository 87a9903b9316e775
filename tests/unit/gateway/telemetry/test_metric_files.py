"""Metrics shared between workers: what the files of several registries sum to, and a scrape's fresh values."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.telemetry.metric_files import MetricFiles

MODES = {"inflight": "livesum", "up": "livemin"}


class Worker:
    """One worker's series, as the gateway makes them: in memory, in a registry of its own."""

    def __init__(self, path: Path, pid: int) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("requests", "Requests.", ("status",), registry=self.registry)
        self.latency = Histogram("latency_seconds", "Latency.", ("model",), buckets=(0.1, 1.0), registry=self.registry)
        self.inflight = Gauge("inflight", "In flight.", registry=self.registry, multiprocess_mode="livesum")
        self.up = Gauge("up", "Up.", registry=self.registry, multiprocess_mode="livemin")
        self.files = MetricFiles(self.registry, str(path), MODES, pid=pid)


@pytest.fixture()
def workers(tmp_path: Path) -> Iterator[Callable[[int], Worker]]:
    made: list[Worker] = []

    def make(pid: int) -> Worker:
        made.append(Worker(tmp_path, pid))
        return made[-1]

    yield make
    for worker in made:
        worker.files.close()


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_the_files_of_two_workers_sum_to_their_registries(workers: Callable[[int], Worker]) -> None:
    a, b = workers(101), workers(102)
    for value in (0.05, 0.5, 0.5, 3.0):
        a.latency.labels("m").observe(value)
    b.latency.labels("m").observe(0.05)
    b.latency.labels("n").observe(2.0)
    a.requests.labels("200").inc(3)
    b.requests.labels("200").inc(2)
    b.requests.labels("502").inc()
    a.inflight.set(2)
    b.inflight.set(5)
    a.up.set(1)
    b.up.set(0)
    a.files.write()
    b.files.write()
    found = samples(a.files.exposition_registry())
    assert found[("requests_total", (("status", "200"),))] == 5
    assert found[("requests_total", (("status", "502"),))] == 1
    m = (("model", "m"),)
    assert found[("latency_seconds_bucket", (("le", "0.1"), *m))] == 2  # cumulative again, as one registry says
    assert found[("latency_seconds_bucket", (("le", "1.0"), *m))] == 4
    assert found[("latency_seconds_bucket", (("le", "+Inf"), *m))] == 5
    assert found[("latency_seconds_count", m)] == 5
    assert abs(found[("latency_seconds_sum", m)] - 4.1) < 1e-9
    assert found[("latency_seconds_count", (("model", "n"),))] == 1
    assert found[("inflight", ())] == 7  # livesum
    assert found[("up", ())] == 0  # livemin


def test_a_write_replaces_the_last_one_and_an_exit_keeps_counters_only(workers: Callable[[int], Worker]) -> None:
    a, b = workers(101), workers(102)
    a.requests.labels("200").inc()
    a.inflight.set(1)
    a.files.write()
    a.requests.labels("200").inc()
    a.files.write()  # values, not increments: writing twice counts nothing twice
    b.inflight.set(4)
    b.files.write()
    assert samples(b.files.exposition_registry())[("requests_total", (("status", "200"),))] == 2
    a.files.close()  # the worker exits: its requests stay counted, its in-flight gauge leaves the sum
    found = samples(b.files.exposition_registry())
    assert found[("requests_total", (("status", "200"),))] == 2
    assert found[("inflight", ())] == 4


async def test_a_scrape_has_the_other_workers_write_first(tmp_path: Path, workers: Callable[[int], Worker]) -> None:
    a, b = workers(101), workers(102)
    await a.files.start()
    await b.files.start()
    b.requests.labels("200").inc(7)  # not yet in b's files: its next write is up to a second away
    assert samples(a.files.exposition_registry()).get(("requests_total", (("status", "200"),)), 0) == 0
    await a.files.gather()
    assert samples(a.files.exposition_registry())[("requests_total", (("status", "200"),))] == 7
    b.files.close()
    (tmp_path / "flush-103.sock").touch()  # a worker killed before it could remove its socket
    await a.files.gather()  # neither the one gone nor the dead socket holds a scrape up
    assert not (tmp_path / "flush-103.sock").exists()
