"""The console's memory: the last N requests as they ended, and what the console's views read out of them.

Recording happens in the completion task (step 6, after the client has its answer): a request's fields written
into its slot of lists made at start-up, a column a field, as references to what the request already holds (its
ids, its durations, its `server-timing` text, its labels, its usage). Everything the page shows (a filtered list,
one request's waterfall, percentiles per tenant and model, cache shares) is computed when the page asks, off the
request path, in a thread that reads the ring as it goes on.

Why columns of references rather than one tuple a request, as it was: what a ring keeps must stay out of the
garbage collector's way. CPython collects its youngest generation once the objects it tracks (tuples, lists,
dicts of containers, class instances) made since the last collection, less those freed, pass a threshold. A full
ring that kept a tuple, the request's timings list with a tuple a stage, its tries and its outcome frees as many
old tracked objects as it keeps new ones, so that count stands still while the youngest generation grows by a
dozen objects a request; the collection comes late and traverses them all (docs/architecture.md, "What a store
keeps must not be tracked": up to 23.7 ms measured with every stage on). Here a request adds no tracked object
(strings, floats, ints and bytes are not tracked; the labels dict holds strings, so it is not tracked either;
usage with nested counts and several tries are kept as their JSON text), and a record takes about 1 KB instead
of 1.7 KB.

Bounded twice: at most `requests` entries, and at most `max_bytes` by an allowance per entry (ENTRY_BYTES, a
request's record with what it references as a gateway keeps it; a unit test measures a large one against it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Mapping
from gc import is_tracked
from typing import TYPE_CHECKING, Any

import orjson

from gateway.telemetry.durations import ms_text, server_timing

if TYPE_CHECKING:
    from gateway.context import Exchange
    from gateway.plugin import Outcome

ENTRY_BYTES = 6144  # the allowance per entry that max_bytes is divided by
ERROR_CHARS = 512  # of an error's text shown
# The stages whose time is the upstream's rather than the gateway's (overhead = total to head - these).
UPSTREAM_STAGES = frozenset({"pool", "upstream"})
# What the views read, made from a kept record when they ask: (wall time, request id, tenant, model, served
# model, backend, endpoint, status, stream, total, ttft, tpot, overhead, upstream, timings, attempts, fallback,
# labels, routed, usage, error).
Entry = tuple[Any, ...]
T, RID, TENANT, MODEL, SERVED, BACKEND, DOOR, STATUS, STREAM, TOTAL, TTFT, TPOT = range(12)
OVERHEAD, UPSTREAM, TIMINGS, ATTEMPTS, FALLBACK, LABELS, ROUTED, USAGE, ERROR = range(12, 21)
# A record's fields, a column each: started, request id, tenant, model, served (the config's Target), endpoint,
# stream, total, overhead, upstream, server-timing, the last try (model, ms, status), every try when there were
# several, fallback, labels, the routed endpoint (endpoint, policy, score), status, ttft, tpot, usage, error.
WIDTH = 25


class Ring:
    """The last `size` requests of this process, in `columns`: record k in slot k % (size + 1) of each.

    A record is written field by field, then counted in `written`; the views read it in a thread while it goes
    on (`entries`). One slot more than `size` is for the record being written, so that `size` whole ones are
    always there to read. The arrival time stays a perf_counter reading, put on the wall clock when read.
    callgrind counts the record in tools/bench/ring.py.
    """

    def __init__(self, requests: int, max_bytes: int) -> None:
        self.size = max(1, min(requests, max_bytes // ENTRY_BYTES))
        self.slots = self.size + 1
        self.columns: list[list[Any]] = [[None] * self.slots for _ in range(WIDTH)]
        self.written = 0  # records written in all: the next goes to slot written % slots

    def record(self, ex: Exchange, outcome: Outcome, total_ms: float) -> None:
        # One store a field into lists made at start-up: no tuple, list or other object the collector tracks
        # is kept.
        (
            started, rid, tenant, model, served, door, stream, total, overhead, upstream, timing,
            tried_model, tried_ms, tried_status, tries, fallback, labels, endpoint, policy, score,
            status, ttft, tpot, usage, error,
        ) = self.columns  # fmt: skip
        i = self.written % self.slots
        text = ex.server_timing
        if text is None:  # no head was sent (the client left first): the stages as far as they went
            text = server_timing(ex.timings, ex.overhead_ms)
        timing[i] = text
        started[i] = ex.started
        rid[i] = ex.request_id
        tenant[i] = ex.tenant
        model[i] = ex.model
        served[i] = ex.served
        door[i] = ex.endpoint
        stream[i] = ex.stream
        total[i] = total_ms
        overhead[i] = ex.overhead_ms
        upstream[i] = ex.upstream_ms
        attempts = ex.attempts
        if attempts:
            last: Any = attempts[-1]  # read as it is: no field unboxed to be boxed again
            tried_model[i] = last[0]
            tried_ms[i] = last[1]
            tried_status[i] = last[2]
            # Several (failover, fallback, hedge): as JSON, since the list and its tuples are tracked objects.
            tries[i] = orjson.dumps(attempts).decode() if len(attempts) > 1 else None
        else:
            tried_model[i] = tried_ms[i] = tried_status[i] = tries[i] = None
        fallback[i] = ex.fallback
        labels[i] = ex.labels
        routed: Any = ex.routed
        if routed is not None:
            endpoint[i] = routed[0]
            policy[i] = routed[1]
            score[i] = routed[2]
        else:
            endpoint[i] = policy[i] = score[i] = None
        status[i] = outcome.status
        ttft[i] = outcome.ttft_ms
        tpot[i] = outcome.tpot_ms
        counts: Any = outcome.usage
        if counts is not None and is_tracked(counts):
            counts = orjson.dumps(counts, default=str).decode()  # counts nested in dicts (OpenAI's details): JSON
        usage[i] = counts
        error[i] = outcome.error
        self.written += 1

    def __len__(self) -> int:
        return min(self.written, self.size)

    def snapshot(self) -> Snapshot:
        """What a view reads the ring through (in a thread, with `entries`), and what puts its perf_counter
        readings on the wall clock."""
        return self, time.time() - time.perf_counter()

    def __iter__(self) -> Iterator[Entry]:
        return entries(self.snapshot())


Snapshot = tuple[Ring, float]


def entries(snapshot: Snapshot, newest_first: bool = False) -> Iterator[Entry]:
    """The records of a snapshot as the views read them, oldest first (or newest first), read from the ring as it
    goes on (in a thread): each made when the view reaches it, so that a view that stops early (a page of
    requests, one id) reads no more, and nothing is copied ahead. A record is read field by field, then checked:
    if the record that takes its slot next has begun meanwhile (`written` has reached it), what was read may be
    partly the newer one's, and it is left out (with every older one, which is overwritten too)."""
    ring, wall = snapshot
    (
        started, rid, tenant, model, served, door, stream, total, overhead, upstream, timing,
        tried_model, tried_ms, tried_status, tries, fallback, labels, endpoint, policy, score,
        status, ttft, tpot, usage, error,
    ) = ring.columns  # fmt: skip
    slots = ring.slots
    written = ring.written
    first = max(0, written - ring.size)
    for k in range(written - 1, first - 1, -1) if newest_first else range(first, written):
        i = k % slots
        target = served[i]
        several = tries[i]
        text = error[i]
        entry = (
            started[i] + wall + total[i] / 1000.0,  # when it ended
            rid[i],
            tenant[i],
            model[i],
            target.model if target is not None else None,
            target.backend if target is not None else None,
            door[i],
            status[i],
            stream[i],
            total[i],
            ttft[i],
            tpot[i],
            overhead[i],
            upstream[i],
            timing[i].decode(),
            several if several is not None else one_try(tried_model[i], tried_ms[i], tried_status[i]),
            fallback[i],
            labels[i],
            (endpoint[i], policy[i], score[i]) if endpoint[i] is not None else None,
            usage[i],
            text[:ERROR_CHARS] if text is not None else None,
        )
        if ring.written >= k + slots:
            if newest_first:
                return
            continue
        yield entry


def usage_of(entry: Entry) -> dict[str, Any] | None:
    """An entry's usage: kept as JSON text when it held nested counts (Ring.record), read back here."""
    usage = entry[USAGE]
    if isinstance(usage, str):
        found: dict[str, Any] = orjson.loads(usage)
        return found
    return usage  # type: ignore[no-any-return]


def attempts_of(entry: Entry) -> list[Any]:
    """An entry's tries, (model, ms, status) each: kept as JSON text when there were several (Ring.record)."""
    tried = entry[ATTEMPTS]
    if isinstance(tried, str):
        found: list[Any] = orjson.loads(tried)
        return found
    return tried or []


def one_try(model: str | None, ms: float | None, status: int | None) -> list[tuple[Any, ...]]:
    return [(model, ms, status)] if model is not None else []


def matches(entry: Entry, query: Mapping[str, str]) -> bool:
    """Whether an entry passes the page's filters: tenant, model (asked for or served), status (200, 5xx),
    door (the endpoint), slow_ms (total at least), id (a prefix of the request id)."""
    tenant = query.get("tenant")
    if tenant and entry[TENANT] != tenant:
        return False
    model = query.get("model")
    if model and model not in (entry[MODEL], entry[SERVED]):
        return False
    status = query.get("status", "").strip().lower()
    if status:
        code = str(entry[STATUS] or 499)
        if status.endswith("xx") and code[:1] != status[:1]:
            return False
        if not status.endswith("xx") and code != status:
            return False
    door = query.get("door")
    if door and entry[DOOR] != door:
        return False
    slow = _number(query.get("slow_ms"))
    if slow is not None and entry[TOTAL] < slow:
        return False
    rid = query.get("id")
    return not (rid and not entry[RID].startswith(rid))


def summary(entry: Entry) -> dict[str, Any]:
    """One line of the requests table."""
    return {
        "at": round(entry[T], 3),
        "id": entry[RID],
        "tenant": entry[TENANT],
        "model": entry[MODEL],
        "served_model": entry[SERVED],
        "door": entry[DOOR],
        "status": entry[STATUS] or 499,
        "stream": entry[STREAM],
        "total_ms": _ms(entry[TOTAL]),
        "ttft_ms": _ms(entry[TTFT]),
        "overhead_ms": _ms(entry[OVERHEAD]),
        "fallback": entry[FALLBACK],
        **{name: str(value) for name, value in entry[LABELS].items()},
    }


def waterfall(entry: Entry) -> dict[str, Any]:
    """One request's stages laid end to end in the order they ran, as its server-timing and its spans have them:
    each with its start (ms since arrival), duration and whose time it is (the gateway's or the upstream's)."""
    stages = []
    at = 0.0
    pool_start: float | None = None
    for name, ms in timings(entry[TIMINGS]):
        start = at
        if name == "pool":
            pool_start = at
        elif name == "upstream" and pool_start is not None:
            start = pool_start  # the upstream wait began with getting its connection
        kind = "upstream" if name in UPSTREAM_STAGES else "gateway"
        stages.append(
            {
                "name": name,
                "start_ms": _ms(at),
                "ms": _ms(ms),
                "dur": ms_text(ms),  # as the response's server-timing wrote it
                "kind": kind,
                "wait_from_ms": _ms(start),
            }
        )
        at += ms
    overhead = entry[OVERHEAD]
    head = overhead + entry[UPSTREAM] if overhead > 0 else None
    attempts = []
    offset = 0.0
    for model, ms, status in attempts_of(entry):
        attempts.append({"model": model, "start_ms": _ms(offset), "ms": _ms(ms), "status": status or "served"})
        offset += ms
    usage = usage_of(entry) or {}
    routed = entry[ROUTED]
    marks = {"head_ms": _ms(head), "first_token_ms": _ms(entry[TTFT]), "last_byte_ms": _ms(entry[TOTAL])}
    return {
        **summary(entry),
        "stages": stages,
        "overhead_ms": _ms(overhead),
        "overhead_dur": ms_text(overhead),
        "upstream_ms": _ms(entry[UPSTREAM]),
        "tpot_ms": _ms(entry[TPOT]),
        "marks": marks,
        "attempts": attempts,
        "routed": {"endpoint": routed[0], "policy": routed[1], "score": routed[2]} if routed else None,
        "backend": entry[BACKEND],
        "usage": usage,
        "error": entry[ERROR],
        "server_timing": server_timing_text(entry),
    }


def server_timing_text(entry: Entry) -> str:
    """What the response's `server-timing` said (three decimals, as the header writes them)."""
    text: str = entry[TIMINGS]
    return text


def timings(text: str) -> list[tuple[str, float]]:
    """The stages of a `server-timing` text, in order, without the overhead that always ends it."""
    found = []
    for part in text.split(", ")[:-1]:
        name, _, duration = part.rpartition(";dur=")
        try:
            found.append((name, float(duration)))
        except ValueError:  # not one the pipeline wrote (a stage's name with ", " in it): left out
            continue
    return found


def percentiles(entries: Iterable[Entry], since: float, step_s: float) -> dict[str, Any]:
    """Per tenant and model over the entries since `since` (wall time): p50, p95, p99 of TTFT, TPOT, end to end
    and overhead; and per model, TTFT and overhead p50/p95 in steps of `step_s` for the chart."""
    groups: dict[tuple[str, str], list[Entry]] = {}
    steps: dict[str, dict[int, list[Entry]]] = {}
    for entry in entries:
        if entry[T] < since:
            continue
        groups.setdefault((entry[TENANT], entry[MODEL]), []).append(entry)
        steps.setdefault(entry[MODEL], {}).setdefault(int((entry[T] - since) // step_s), []).append(entry)
    table = []
    for (tenant, model), members in sorted(groups.items()):
        ok = [e for e in members if (e[STATUS] or 499) < 400]
        table.append(
            {
                "tenant": tenant,
                "model": model,
                "requests": len(members),
                "errors": len(members) - len(ok),
                "ttft": _quantiles([e[TTFT] for e in ok]),
                "tpot": _quantiles([e[TPOT] for e in ok]),
                "e2e": _quantiles([e[TOTAL] for e in members]),
                "overhead": _quantiles([e[OVERHEAD] for e in members if e[OVERHEAD] > 0]),
            }
        )
    chart = {
        model: [
            {
                "at": round(since + (i + 1) * step_s, 3),
                "requests": len(members),
                "ttft": _quantiles([e[TTFT] for e in members if (e[STATUS] or 499) < 400]),
                "overhead": _quantiles([e[OVERHEAD] for e in members if e[OVERHEAD] > 0]),
            }
            for i, members in sorted(by_step.items())
        ]
        for model, by_step in sorted(steps.items())
    }
    return {"since": since, "step_s": step_s, "table": table, "chart": chart}


def shares(entries: Iterable[Entry], since: float) -> dict[str, Any]:
    """Per model since `since`: each plugin label's values as shares (the caches: hit, miss, bypass), and the
    share of input tokens the provider served from its prompt cache."""
    counts: dict[str, dict[str, dict[str, int]]] = {}
    tokens: dict[str, list[int]] = {}
    for entry in entries:
        if entry[T] < since:
            continue
        model = entry[MODEL]
        labels = counts.setdefault(model, {})
        for name, value in entry[LABELS].items():
            values = labels.setdefault(name, {})
            values[str(value)] = values.get(str(value), 0) + 1
        usage = usage_of(entry)
        if usage:
            prompt = usage.get("prompt_tokens")
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            if isinstance(prompt, int) and prompt > 0:
                total = tokens.setdefault(model, [0, 0])
                total[0] += prompt
                total[1] += cached if isinstance(cached, int) and cached > 0 else 0
    result: dict[str, Any] = {}
    for model in sorted(set(counts) | set(tokens)):
        fractions: dict[str, dict[str, float]] = {
            name: {value: round(n / sum(values.values()), 4) for value, n in sorted(values.items())}
            for name, values in counts.get(model, {}).items()
        }
        prompt_tokens, cached_tokens = tokens.get(model, (0, 0))
        share = round(cached_tokens / prompt_tokens, 4) if prompt_tokens else None
        result[model] = {"labels": fractions, "prompt_cache": share}
    return result


def _quantiles(values: list[float | None]) -> dict[str, float | None]:
    known = sorted(v for v in values if v is not None)
    if not known:
        return {"p50": None, "p95": None, "p99": None}
    n = len(known)  # nearest rank: the smallest value with at least q of them at or below it
    return {name: _ms(known[max(0, math.ceil(q * n) - 1)]) for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))}


def _ms(value: float | None) -> float | None:
    return round(value, 3) if value is not None else None


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None
