"""Metrics: the Prometheus series of `/metrics`, recorded once per request in the completion task.

Latency histograms are in seconds, labelled by tenant, public model, served model, backend, stream and cache
result, with the GenAI conventions' boundaries (to ~82 s) below which finer ones resolve the gateway's own
sub-millisecond overhead. Counters cover requests by status, tokens, cache results, fallbacks, rate-limit
rejections, Redis failures and the fate of trace spans; gauges the requests in flight and each model's SLO
state.

Plugins own their series (the Envoy model): they make them at start-up through the `Meter` they are given
(`runtime.meter`), in the same registry, and add labels to the request series by declaring them in their
schema and setting `ex.labels`. This module never names a plugin.

Recording is cheap: the labelled children of one label tuple are looked up once and kept, and a request's
observations and counts wait in its series (plain lists and integers, after its response has ended and never
per chunk) until `BATCH` requests have added theirs or something reads the values (a scrape, a worker's file
write): then each histogram gets its sum once and each bucket its count once, where prometheus_client would
take a lock, test the metric and walk the bucket bounds for every observation. The tenant label is bounded
(`telemetry.max_tenants`, then `other`).

With several worker processes (`sluice serve --workers N`) every worker keeps its values in memory as one
process does, writes them to files in a shared directory in batches, and a scrape, whichever worker answers
it, has the others write theirs and sums them all (gateway/telemetry/metric_files.py: no file write per request).
Under prometheus_client's own multiprocess mode (`PROMETHEUS_MULTIPROC_DIR` set by whatever runs the
gateway) every value is written to its file as it changes, and scrapes sum those. Exemplars (the trace id of
a sampled request on the bucket it fell in) are kept with one process and shown to scrapers that ask for
OpenMetrics; the multiprocess files have no place for them.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from gateway import __version__
from gateway.telemetry import metric_files
from gateway.telemetry.series import HISTOGRAMS, Series, prompt_cache
from gateway.telemetry.tally import Tally

if TYPE_CHECKING:
    from gateway.context import Exchange
    from gateway.plugin import Outcome
    from gateway.settings import TelemetrySettings
    from gateway.state.store import Store
    from gateway.upstream.health import Health

# GenAI operation-duration boundaries (0.01 s doubling to 81.92 s) with finer ones below them.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
    40.96, 81.92,
)  # fmt: skip
# GenAI time-per-output-token boundaries, from 1 ms.
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# The gateway's own time per request: tens of microseconds when all is well, milliseconds when it is not.
OVERHEAD_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
CORE_LABELS = ("tenant", "model", "served_model", "backend", "stream")
OTHER_TENANT = "other"
BATCH = 256  # requests a series holds before it adds their values to its children (a read adds them at once)


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class TenantLabels:
    """At most `limit` tenant label values: the configured tenants first, then the first ones seen."""

    def __init__(self, limit: int, known: Iterable[str]) -> None:
        self.limit = limit
        self.labels: dict[str, str] = {name: name for name in sorted(known)[:limit]}

    def __call__(self, tenant: str) -> str:
        label = self.labels.get(tenant)
        if label is None:
            if len(self.labels) >= self.limit:
                return OTHER_TENANT
            label = self.labels[tenant] = tenant
        return label


MAX_KEYS = 4096  # exchange keys (raw tenant, model, target, stream) remembered; past them labels are made again


class NotServed:
    """The target of an exchange no backend served (a plugin's answer, an error): empty labels."""

    model = ""
    backend = ""


NOT_SERVED = NotServed()
NO_USAGE: dict[str, Any] = {}  # never changed


class Metrics:
    def __init__(
        self,
        settings: TelemetrySettings,
        tenants: Iterable[str] = (),
        labels: Mapping[str, str] | None = None,
        store: Store | None = None,
        backends: Mapping[str, Health] | None = None,
    ) -> None:
        """`labels`: the request-series labels plugins declared, with the value of a request that set none."""
        self.directory = multiprocess_dir()  # prometheus_client's own multiprocess mode
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.gauge_modes = {"sluice_inflight_requests": "livesum", "sluice_backend_up": "livemin", **PROCESS_MODES}
        shared = metric_files.directory() if self.directory is None else None
        self.files = (
            metric_files.MetricFiles(registry, shared, self.gauge_modes, before_write=self.before_write)
            if shared
            else None
        )
        self.exemplars = self.directory is None and self.files is None
        # prometheus_client's own multiprocess mode writes every value to its file as it changes, and a scrape
        # reads the files of every process: there values cannot wait in this process.
        self.batched = self.directory is None
        self.extra = dict(labels or {})
        self.extra_names = tuple(self.extra)
        self.extra_defaults = tuple(self.extra.values())
        names = (*CORE_LABELS, *self.extra)
        self._request_families(names)
        self._gateway_families()
        self.process = ProcessGauges(registry)
        self.backends = dict(backends or {})
        self.exhausted_seen = {name: 0 for name in self.backends}
        self.tenant_label = TenantLabels(settings.max_tenants, tenants)
        self.series: dict[tuple[str, ...], Series] = {}  # by labels
        self.by_key: dict[tuple[Any, ...], Series] = {}  # by what record() reads first: see _series
        self.batch = BATCH if self.batched else 1  # requests a series holds before its values are added
        self.open = {True: self.inflight.labels("true"), False: self.inflight.labels("false")}
        # Batched: requests begun and not yet in a flushed series, set on the gauge when it is read.
        self.opened = {True: 0, False: 0}
        self.store = store
        self.store_seen = 0
        self.span_counters: dict[str, Any] = {}
        self.tallies: list[Tally] = []  # the plugins' per-request counters, added at each flush

    def _gateway_families(self) -> None:
        """The gateway's own series: fallbacks, plugin refusals, Redis failures, spans, requests in flight,
        backends up, full pools, and its build."""
        registry = self.registry
        self.fallbacks = Counter(
            "sluice_fallbacks_total",
            "Requests not served by their first target, by reason (slo, deadline, error, hedge).",
            ("model", "served_model", "reason"),
            registry=registry,
        )
        self.rejections = Counter(
            "sluice_plugin_rejections_total",
            "Requests a plugin refused before any upstream was tried, by plugin and status.",
            ("tenant", "model", "plugin", "status"),
            registry=registry,
        )
        self.redis_failures = Counter(
            "sluice_redis_failures_total", "Redis calls that failed or timed out.", registry=registry
        )
        self.trace_spans = Counter(
            "sluice_trace_spans_total",
            "Trace spans by fate: exported, export_failed, or dropped (the export queue was full).",
            ("result",),
            registry=registry,
        )
        self.inflight = Gauge(
            "sluice_inflight_requests",
            "Requests between routing and completion (stream=true: open streams).",
            ("stream",),
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.backend_up = Gauge(
            "sluice_backend_up",
            "1 while the gateway can reach the backend, 0 while it is down (the least over worker processes).",
            ("backend",),
            registry=registry,
            multiprocess_mode="livemin",
        )
        self.pool_exhausted = Counter(
            "sluice_upstream_pool_exhausted_total",
            "Requests answered 503 because every connection to the backend was busy (pool.max_connections).",
            ("backend",),
            registry=registry,
        )
        build = Gauge(
            "sluice_build_info",
            "1, labelled with the gateway's version and the Python that runs it.",
            ("version", "python"),
            registry=registry,
            multiprocess_mode="livemax",
        )
        build.labels(__version__, platform.python_version()).set(1)

    def _request_families(self, names: tuple[str, ...]) -> None:
        """The series each request adds to: its latencies, its status and its tokens, by the request labels."""
        registry = self.registry
        self.ttft = Histogram(
            "sluice_time_to_first_token_seconds",
            "Arrival to the first output token (streams) or to the whole answer.",
            names,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "sluice_time_per_output_token_seconds",
            "Mean time per output token after the first, per stream.",
            names,
            buckets=TPOT_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            "sluice_request_duration_seconds",
            "Arrival to the last byte sent.",
            names,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.upstream = Histogram(
            "sluice_upstream_duration_seconds",
            "Time spent waiting on upstreams for the response head (and first chunk), every try included.",
            names,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.overhead = Histogram(
            "sluice_overhead_seconds",
            "The gateway's own time before the response head: arrival to head minus upstream wait.",
            names,
            buckets=OVERHEAD_BUCKETS,
            registry=registry,
        )
        self.requests = Counter(
            "sluice_requests_total",
            "Requests by the status sent to the client (499: the client left before the head).",
            (*names, "status"),
            registry=registry,
        )
        self.tokens = Counter(
            "sluice_tokens_total",
            "Tokens reported in upstream usage, by direction: input, output, and of the input those read from "
            "(cache_read) and written to (cache_write) the provider's prompt cache.",
            (*names[:4], "direction"),
            registry=registry,
        )
        # Each request histogram's bucket bounds as its children observe them (seconds, the last +Inf): a series
        # counts its requests into these buckets itself (series.py).
        self.bounds: tuple[tuple[float, ...], ...] = tuple(
            tuple(getattr(self, name)._upper_bounds) for name in HISTOGRAMS
        )

    # -- the request path ---------------------------------------------------------------------------------

    def begin(self, ex: Exchange) -> None:
        if self.batched:
            self.opened[ex.stream] += 1
        else:
            self.open[ex.stream].inc()

    def rejected(self, status: int) -> None:
        self.requests.labels("unknown", "", "", "", "", *self.extra.values(), str(status)).inc()

    # -- the completion task ------------------------------------------------------------------------------

    def record(self, ex: Exchange, outcome: Outcome, total_ms: float, trace_id: str | None) -> None:
        """One request's values into its series; they leave flight (the gauge) when the series is flushed."""
        served = ex.served or NOT_SERVED
        key: tuple[Any, ...] = (ex.tenant, ex.model, served.model, served.backend, ex.stream)
        if self.extra:
            # map() over the bound get: no comprehension frame a request (callgrind: -1.3k instructions)
            key += tuple(map(ex.labels.get, self.extra_names, self.extra_defaults))
        series = self.by_key.get(key)
        if series is None:
            series = self._series(ex, key)
        status = outcome.status
        usage = outcome.usage or NO_USAGE
        ok = status < 400  # an error body is no first token
        read, written = prompt_cache(usage)
        counts = (usage.get("prompt_tokens"), usage.get("completion_tokens"), read, written)
        ttft_ms = outcome.ttft_ms if ok else None
        tpot_ms = outcome.tpot_ms if ok else None
        upstream_ms = ex.upstream_ms if ex.attempts else None
        # Exemplars only where they can be shown: the multiprocess files do not keep them.
        if trace_id is not None and self.exemplars:
            exemplar = {"trace_id": trace_id}
            series.record_traced(status, total_ms, ttft_ms, tpot_ms, upstream_ms, ex.overhead_ms, counts, exemplar)
        else:
            series.record(status, total_ms, ttft_ms, tpot_ms, upstream_ms, ex.overhead_ms, counts)
        if series.held >= self.batch:
            series.flush()
        if ex.fallback is not None:
            self.fallbacks.labels(ex.model, series.labels[2], ex.fallback).inc()
        if ex.rejected_by is not None:
            self.rejections.labels(series.labels[0], ex.model, ex.rejected_by, str(status)).inc()
        store = self.store
        if store is not None and store.failures != self.store_seen:
            self.sync()

    def ended(self, stream: bool, count: int) -> None:
        """`count` requests recorded (their series flushed): out of flight."""
        if self.batched:
            self.opened[stream] -= count
        else:
            self.open[stream].dec(count)

    def _series(self, ex: Exchange, key: tuple[Any, ...]) -> Series:
        """The series of an exchange key first seen: its labels made (the tenant's bounded), and remembered.

        A raw tenant's label never changes once given (tenants are only ever added to the bounded set), so
        the key may stand for the labels; keys stop being remembered past MAX_KEYS (tenants without bound).
        """
        served = ex.served
        labels: tuple[str, ...] = (
            self.tenant_label(ex.tenant),
            ex.model,
            served.model if served is not None else "",
            served.backend if served is not None else "",
            "true" if ex.stream else "false",
            *key[5:],  # the plugins' labels
        )
        series = self.series.get(labels)
        if series is None:
            series = self.series[labels] = Series(self, labels)
        if len(self.by_key) < MAX_KEYS:
            self.by_key[key] = series
        return series

    def count_spans(self, result: str, count: int) -> None:
        """Called from the export thread too: prometheus_client's values are locked."""
        counter = self.span_counters.get(result)
        if counter is None:
            counter = self.span_counters[result] = self.trace_spans.labels(result)
        counter.inc(count)

    def sync(self) -> None:
        """Bring the series read from elsewhere (Redis failures) up to date."""
        store = self.store
        if store is not None and store.failures != self.store_seen:
            self.redis_failures.inc(max(store.failures - self.store_seen, 0))
            self.store_seen = store.failures

    # -- /metrics -----------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.files is not None:
            await self.files.start()

    def refresh_process(self) -> None:
        self.process.refresh()

    def before_write(self) -> None:
        """Before this worker writes its values to the shared files: the waiting ones in, the process's read."""
        self.flush()
        self.process.refresh()

    def flush(self) -> None:
        """Every request's values that wait in a series added to the Prometheus children, and the gauge of
        requests in flight set."""
        for series in self.series.values():
            series.flush()
        for tally in self.tallies:
            tally.flush()
        if self.batched:  # after the flushes, which take the requests they count out of flight
            for stream, count in self.opened.items():
                self.open[stream].set(count)

    def refresh(self) -> None:
        """The series read at scrape time from elsewhere (Redis failures, backend health): nothing per request."""
        self.flush()
        self.sync()
        self.process.refresh()
        for name, health in self.backends.items():
            self.backend_up.labels(name).set(0 if health.down else 1)
            if health.pool_exhausted != self.exhausted_seen[name]:
                self.pool_exhausted.labels(name).inc(health.pool_exhausted - self.exhausted_seen[name])
                self.exhausted_seen[name] = health.pool_exhausted

    async def gather(self) -> None:
        """Before a scrape: with several workers, every live worker's values written where the scrape sums them."""
        if self.files is not None:
            self.refresh()
            await self.files.gather()

    def exposition(self, accept: str) -> tuple[bytes, str]:
        """The body and content type of a scrape: OpenMetrics (with exemplars) if asked for, else text 0.0.4."""
        self.refresh()
        registry = self.registry
        if self.files is not None:
            self.files.write()
            registry = self.files.exposition_registry()
        elif self.directory is not None:
            registry = CollectorRegistry()
            MultiProcessCollector(registry, self.directory)
        encode, content_type = choose_encoder(accept)
        return encode(registry), content_type

    def close(self) -> None:
        if self.files is not None:
            self.files.close()
        if self.directory is not None:
            # This process's gauges (in flight, and the plugins') stop counting; its counters stay in the sums.
            mark_process_dead(os.getpid(), self.directory)


# The standard process series (prometheus_client's names), and how several workers' values add up: memory, CPU
# and descriptors are the gateway's total over its workers, the start time the earliest, the limit the least.
PROCESS_MODES = {
    "process_resident_memory_bytes": "livesum",
    "process_virtual_memory_bytes": "livesum",
    "process_open_fds": "livesum",
    "process_max_fds": "livemin",
    "process_start_time_seconds": "livemin",
}


class ProcessGauges:
    """The `process_*` series, read from /proc by prometheus_client's own collector at each scrape and write.

    They are copied into series of the gateway's registry, rather than the collector registered there, so that
    with several workers each worker's values reach the files a scrape sums (the collector's do not).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.reader = ProcessCollector(registry=None)
        self.gauges = {
            name: Gauge(name, HELP[name], registry=registry, multiprocess_mode=mode)  # type: ignore[arg-type]
            for name, mode in PROCESS_MODES.items()
        }
        self.cpu = Counter("process_cpu_seconds", "Total user and system CPU time spent in seconds.", registry=registry)
        self.cpu_seen = 0.0

    def refresh(self) -> None:
        for family in self.reader.collect():
            for sample in family.samples:
                gauge = self.gauges.get(sample.name)
                if gauge is not None:
                    gauge.set(sample.value)
                elif sample.name == "process_cpu_seconds_total" and sample.value > self.cpu_seen:
                    self.cpu.inc(sample.value - self.cpu_seen)
                    self.cpu_seen = sample.value


HELP = {
    "process_resident_memory_bytes": "Resident memory size in bytes.",
    "process_virtual_memory_bytes": "Virtual memory size in bytes.",
    "process_open_fds": "Number of open file descriptors.",
    "process_max_fds": "Maximum number of open file descriptors.",
    "process_start_time_seconds": "Start time of the process since unix epoch in seconds.",
}


class Meter:
    """What a plugin is given to make series of its own in the gateway's registry (runtime.meter)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.registry = metrics.registry
        self.modes = metrics.gauge_modes
        self.tenant = metrics.tenant_label  # the bounded tenant label: use it for any tenant-labelled series

    def counter(self, name: str, documentation: str, labels: Iterable[str]) -> Counter:
        return Counter(name, documentation, tuple(labels), registry=self.registry)

    def tally(self, name: str, documentation: str, labels: Iterable[str]) -> Tally:
        """A counter that a request bumps (tally.py): its increments wait until the metrics are read."""
        tally = Tally(self.counter(name, documentation, labels), self.metrics.batched)
        self.metrics.tallies.append(tally)
        return tally

    def gauge(
        self, name: str, documentation: str, labels: Iterable[str], mode: Literal["livesum", "livemin"] = "livesum"
    ) -> Gauge:
        """With several workers a scrape shows the sum over the live ones (`livemin`: the least of them)."""
        self.modes[name] = mode
        return Gauge(name, documentation, tuple(labels), registry=self.registry, multiprocess_mode=mode)
