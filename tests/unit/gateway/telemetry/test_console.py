"""The console's ring and views (gateway/telemetry/console.py) on requests built as the pipeline leaves them."""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

from gateway.context import Exchange, Target
from gateway.plugin import Outcome
from gateway.settings import ModelSettings
from gateway.simulation.answers import Profile
from gateway.telemetry import console
from gateway.telemetry.console import ENTRY_BYTES, Ring
from gateway.telemetry.durations import server_timing
from gateway.upstream.providers.simulated import SimulatedProvider


def request(
    rid: str = "rid-1", model: str = "chat", tenant: str = "acme", status: int = 200, ttft: float = 80.0
) -> tuple[Exchange, Outcome]:
    body = {"model": model, "messages": [], "stream": True}
    ex = Exchange(rid, "chat/completions", [], b"{}", body, time.perf_counter())
    ex.tenant = tenant
    # A real Target, as the pipeline leaves: a compiled Exchange checks the class of what it holds.
    ex.served = Target(model, "sim", model, ModelSettings(backend="sim"), SimulatedProvider(Profile(), "sim"))
    ex.timings = [("parse", 0.1234), ("auth", 0.0004999), ("cache", 0.2), ("route", 0.05), ("pool", 1.5)]
    ex.timings.append(("upstream", 48.25))
    ex.upstream_ms = 49.75
    ex.overhead_ms = 0.61
    ex.attempts = [(model, 20.0, 503), (model, 29.75, 0)]
    ex.fallback = None
    ex.labels = {"cache": "miss"}
    ex.routed = ("10.0.0.1:8000", "least_load", 0.5)
    usage = {"prompt_tokens": 1000, "completion_tokens": 20, "prompt_tokens_details": {"cached_tokens": 600}}
    outcome = Outcome(status=status, complete=True, ttft_ms=ttft, tpot_ms=5.0, total_ms=200.0, usage=usage)
    return ex, outcome


def test_a_waterfall_has_the_stages_and_durations_of_server_timing() -> None:
    ring = Ring(10, 1 << 20)
    ex, outcome = request()
    ring.record(ex, outcome, 200.0)
    (entry,) = list(ring)
    waterfall = console.waterfall(entry)
    header = server_timing(ex.timings, ex.overhead_ms).decode()
    assert waterfall["server_timing"] == header
    shown = [f"{s['name']};dur={s['dur']}" for s in waterfall["stages"]] + [f"overhead;dur={waterfall['overhead_dur']}"]
    assert ", ".join(shown) == header
    stages = {s["name"]: s for s in waterfall["stages"]}
    assert stages["auth"]["dur"] == "0.000"  # rounded as the header's table rounds
    assert stages["parse"]["start_ms"] == 0.0
    assert stages["auth"]["start_ms"] == 0.123
    assert stages["upstream"]["wait_from_ms"] == stages["pool"]["start_ms"]  # the wait began with the connection
    assert [s["kind"] for s in waterfall["stages"]] == ["gateway"] * 4 + ["upstream"] * 2
    assert waterfall["marks"] == {"head_ms": 50.36, "first_token_ms": 80.0, "last_byte_ms": 200.0}
    assert [a["status"] for a in waterfall["attempts"]] == [503, "served"]
    assert waterfall["attempts"][1]["start_ms"] == 20.0
    assert waterfall["routed"] == {"endpoint": "10.0.0.1:8000", "policy": "least_load", "score": 0.5}


def test_filters() -> None:
    ring = Ring(10, 1 << 20)
    sent = (("a1", "chat", "acme", 200), ("b2", "big", "beta", 503), ("c3", "chat", "x", 429))
    for rid, model, tenant, status in sent:
        ring.record(*request(rid, model, tenant, status), 200.0)
    entries = list(ring)

    def ids(**query: str) -> list[str]:
        return [e[console.RID] for e in entries if console.matches(e, query)]

    assert ids() == ["a1", "b2", "c3"]
    assert ids(tenant="beta") == ["b2"]
    assert ids(model="chat") == ["a1", "c3"]
    assert ids(status="5xx") == ["b2"]
    assert ids(status="429") == ["c3"]
    assert ids(status="4XX") == ["c3"]
    assert ids(door="embeddings") == []
    assert ids(slow_ms="199") == ["a1", "b2", "c3"]
    assert ids(slow_ms="201") == []
    assert ids(slow_ms="not a number") == ["a1", "b2", "c3"]
    assert ids(id="b") == ["b2"]


def test_percentiles_and_shares() -> None:
    ring = Ring(1000, 1 << 20)
    for i in range(100):
        ring.record(*request(f"r{i}", ttft=float(i + 1)), 200.0)
    ring.record(*request("err", status=502, ttft=10_000.0), 200.0)
    entries = list(ring)
    found = console.percentiles(entries, time.time() - 60.0, 2.0)
    (row,) = found["table"]
    assert row["requests"] == 101
    assert row["errors"] == 1
    assert row["ttft"] == {"p50": 50.0, "p95": 95.0, "p99": 99.0}  # nearest rank; the error's TTFT is none
    assert row["overhead"]["p99"] == 0.61
    assert sum(point["requests"] for point in found["chart"]["chat"]) == 101
    assert console.percentiles(entries, time.time() + 1.0, 2.0)["table"] == []  # nothing that recent
    shares = console.shares(entries, time.time() - 60.0)
    assert shares["chat"] == {"labels": {"cache": {"miss": 1.0}}, "prompt_cache": 0.6}


def test_the_ring_is_bounded_in_entries_and_bytes() -> None:
    assert Ring(10_000, 64 << 20).size == 10_000
    assert Ring(10_000, 1 << 20).size == (1 << 20) // ENTRY_BYTES
    ring = Ring(3, 1 << 20)
    for i in range(5):
        ring.record(*request(f"r{i}"), 1.0)
    assert [e[console.RID] for e in ring] == ["r2", "r3", "r4"]


def deep_size(value: Any, seen: set[int]) -> int:
    if id(value) in seen:
        return 0
    seen.add(id(value))
    size = sys.getsizeof(value)
    if isinstance(value, dict):
        size += sum(deep_size(k, seen) + deep_size(v, seen) for k, v in value.items())
    elif isinstance(value, list | tuple):
        size += sum(deep_size(v, seen) for v in value)
    elif hasattr(value, "__dict__"):
        size += deep_size(vars(value), seen)
    return size


def test_a_large_entry_fits_its_allowance() -> None:
    """A request with every stage, three tries, long ids and labels, and a full usage: within ENTRY_BYTES."""
    ex, outcome = request("r" * 128, "m" * 64, "t" * 64)
    ex.timings = [(name, 1.0) for name in ("parse", "auth", "rate_limit", "cache", "semantic_cache", "slo")]
    ex.timings += [("route", 0.1), ("pool", 0.2), ("upstream", 50.0)]
    ex.attempts = [("m" * 64, 10.0, 503), ("m" * 64, 10.0, 504), ("n" * 64, 30.0, 0)]
    ex.labels = {"cache": "miss", "semantic_cache": "near"}
    ex.attributes = {"sluice.semantic.similarity": 0.91}
    ex.fallback = "error"
    usage = dict(outcome.usage or {})
    usage["completion_tokens_details"] = {"reasoning_tokens": 100, "accepted_prediction_tokens": 0}
    outcome.usage = usage
    outcome.error = "upstream 503: " + "x" * 600  # shown in part
    ring = Ring(1, 1 << 20)
    ring.record(ex, outcome, 100.0)
    kept = [column[0] for column in ring.columns]  # its slot, as a list of its own: the slot's pointers and more
    assert deep_size(kept, {id(ex.served)}) <= ENTRY_BYTES  # the target is the config's, shared by all
    (entry,) = list(ring)
    assert len(entry[console.ERROR]) == console.ERROR_CHARS
    kept_usage = console.usage_of(entry)
    assert kept_usage is not None
    assert kept_usage["completion_tokens_details"]["reasoning_tokens"] == 100  # kept whole
    assert [tuple(tried) for tried in console.attempts_of(entry)] == ex.attempts


def test_a_full_ring_leaves_the_collector_nothing_new() -> None:
    """Recording adds no object the garbage collector tracks (docstring of telemetry/console.py): the youngest
    generation does not grow with requests recorded, once the requests themselves exist."""
    ring = Ring(100, 1 << 20)
    made = []
    for i in range(300):
        ex, outcome = request(f"r{i}")  # two tries, usage with nested counts (OpenAI's shape)
        if i % 2:
            ex.attempts = ex.attempts[-1:]  # one try, as most requests
        ex.server_timing = server_timing(ex.timings, ex.overhead_ms)  # as the pipeline leaves it
        made.append((ex, outcome))
    enabled = gc.isenabled()
    gc.disable()
    try:
        young = len(gc.get_objects(0))
        for ex, outcome in made:
            ring.record(ex, outcome, 200.0)
        grown = len(gc.get_objects(0)) - young
    finally:
        if enabled:
            gc.enable()
    assert grown < 10, f"{grown} tracked objects kept by 300 records"  # a tuple a record kept 12 a request
    kept = list(ring)
    assert [e[console.RID] for e in kept][-1] == "r299"
    assert len(kept) == len(ring) == 100
    assert console.usage_of(kept[-1]) == made[-1][1].usage
    assert [len(console.attempts_of(e)) for e in kept[-2:]] == [2, 1]


def test_a_view_leaves_out_what_records_written_meanwhile_may_have_overwritten() -> None:
    ring = Ring(3, 1 << 20)  # four slots
    for i in range(5):
        ring.record(*request(f"r{i}"), 1.0)
    assert [e[console.RID] for e in ring] == ["r2", "r3", "r4"]
    oldest_first = console.entries(ring.snapshot())
    assert next(oldest_first)[console.RID] == "r2"
    for i in (5, 6):  # into r1's and r2's slots; the next one, r7, would take r3's
        ring.record(*request(f"r{i}"), 1.0)
    assert [e[console.RID] for e in oldest_first] == ["r4"]  # r3 may be being overwritten: left out
    newest_first = console.entries(ring.snapshot(), newest_first=True)
    assert next(newest_first)[console.RID] == "r6"
    ring.record(*request("r7"), 1.0)
    assert [e[console.RID] for e in newest_first] == ["r5"]  # r4 may be being overwritten: it and older left out
    assert len(list(ring)) == 3


def test_a_waterfall_reads_any_stage_name_the_header_can_carry() -> None:
    """A stage may be called `overhead` (only the last part is the gateway's own); a name with ", " in it is read
    as far as it can be, and never fails the view."""
    text = "parse;dur=0.100, overhead;dur=0.200, odd, name;dur=0.300, upstream;dur=5.000, overhead;dur=0.400"
    assert console.timings(text) == [("parse", 0.1), ("overhead", 0.2), ("name", 0.3), ("upstream", 5.0)]
