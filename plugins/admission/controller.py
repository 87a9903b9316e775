"""admission: priority classes, and the gateway's own queue in front of a saturated backend.

Every request gets a class (config `admission.classes`, highest first): its tenant's default, or the one it
asks for with `x-sluice-priority`, within the tenant's `max_class` (above it: clamped, or 403 with
`above_allowed: refuse`); background jobs get `background_class` (the lowest unless told). The class is the
request series' `priority` label, a span attribute and a field of the access line, and goes back to the
client as `x-sluice-priority`. Upstream, it becomes vLLM's `priority` and OpenAI's and Azure's
`service_tier` where the class says so (`propagation.py`).

A backend named under `admission.backends` has a capacity: `max_in_flight` per endpoint in service. Up to it
requests pass at once; beyond it they wait here (`queue.py`), by class and fairly across the tenants of a
class, and each freed slot wakes the next in that order. A sheddable class whose predicted time to first
token exceeds its `ttft_slo_ms` is refused at once (503, `retry-after`, code `priority_shed`), as is one
that has waited that long; a class that is not sheddable waits its turn. A class with `spill` goes to the first
fallback whose backend has room rather than wait (`x-sluice-fallback: overload`). The gate is the backend of
the request's first target, as the slo plugin left `ex.targets`: list this plugin after it.

Imports: the core (gateway.*) only.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from gateway import errors
from gateway.plugin import Configured, Empty, Problem, Schema
from plugins.admission.capacity import READABLE, Reader
from plugins.admission.config import (
    HEADER,
    AdmissionSection,
    AdmissionTenant,
    Class,
    TenantClasses,
)
from plugins.admission.propagation import PROPAGATED, TIER_HEADER, Fields, fields_by_class, served_tier
from plugins.admission.queue import Full, Gate

if TYPE_CHECKING:
    from gateway.context import Exchange
    from gateway.plugin import Outcome, ResponseHead, Tap
    from gateway.runtime import Runtime
    from gateway.settings import Settings

__all__ = ["HEADER", "Admission", "Gate"]

NAME = "admission"
LABEL = "priority"
QUEUE_MS = "sluice.queue_ms"  # span attribute (and access-line field): the time a request waited for a slot
Config = Configured[AdmissionSection, Empty, AdmissionTenant]


def _default_rank(section: AdmissionSection) -> int:
    return len(section.classes) // 2 if section.default_class is None else _rank(section, section.default_class)


def _rank(section: AdmissionSection, name: str) -> int:
    return next(i for i, c in enumerate(section.classes) if c.name == name)


class Admission:
    name: ClassVar[str] = NAME
    # After whatever may answer or reorder the targets: a cache hit never queues, and the gate is the backend
    # the slo plugin put first. After auth: the class is the tenant's.
    schema: ClassVar[Schema] = Schema(
        section=AdmissionSection,
        tenant=AdmissionTenant,
        after=("auth", "rate_limit", "cache", "semantic_cache", "slo"),
        labels={LABEL: ""},
    )

    @classmethod
    def check(cls, config: Config, settings: Settings, listed: Sequence[str]) -> Iterable[Problem]:
        section = config.section
        names = {c.name for c in section.classes}
        for key in ("default_class", "background_class"):
            value = getattr(section, key)
            if value is not None and value not in names:
                yield f"admission.{key}", f"no class named {value!r} (classes: {', '.join(sorted(names))})"
        for backend, capacity in section.backends.items():
            defined = settings.backends.get(backend)
            if defined is None:
                yield f"admission.backends.{backend}", f"no backend named {backend!r}"
                continue
            if capacity.capacity == "auto" and defined.type not in READABLE:
                yield (
                    f"admission.backends.{backend}.capacity",
                    f"auto reads the capacity of vllm and llamacpp engines; {backend!r} is {defined.type}",
                )
            if capacity.engine_preempts and section.classes[0].vllm_priority is None:
                yield (
                    f"admission.backends.{backend}.engine_preempts",
                    f"the engine preempts by the priority it is sent: class {section.classes[0].name!r} needs a "
                    "vllm_priority",
                )
        for tenant, spec in config.tenants.items():
            for key, value in (("class", spec.priority.class_), ("max_class", spec.priority.max_class)):
                if value is not None and value not in names:
                    yield f"tenants.{tenant}.priority.{key}", f"no class named {value!r}"

    def __init__(self, config: Config, settings: Settings) -> None:
        section = config.section
        self.section = section
        self.classes = tuple(
            Class(c.name, rank, c.sheddable, c.ttft_slo_ms / 1000.0, c.name.encode(), c.spill)
            for rank, c in enumerate(section.classes)
        )
        self.by_name = {c.name.encode(): c for c in self.classes}
        default = self.classes[_default_rank(section)]
        self.anyone = TenantClasses(default, default, 1)  # a tenant the config does not name
        self.tenants: dict[str, TenantClasses] = {}
        for tenant, spec in config.tenants.items():
            own = self.classes[_rank(section, spec.priority.class_)] if spec.priority.class_ else default
            top = self.classes[_rank(section, spec.priority.max_class)] if spec.priority.max_class else own
            self.tenants[tenant] = TenantClasses(own, top if top.rank <= own.rank else own, spec.priority.weight)
        lowest = self.classes[-1]
        self.background = self.classes[_rank(section, section.background_class)] if section.background_class else lowest
        self.refuse = section.above_allowed == "refuse"
        self.fields = fields_by_class(section.classes, settings)  # rank -> backend -> fields, or None
        # on_response reports the service tier served; without a class that asks for one it has nothing to do.
        self.idle = frozenset() if any(self._tiered(f) for f in self.fields) else frozenset({"on_response"})
        self.gates: dict[str, Gate] = {}
        self.readers: list[Reader] = []  # capacity: auto, one a backend
        self.shed: Any = None
        self.queued: Any = None
        self.queue_seconds: Any = None
        self.waiting: Any = None

    @staticmethod
    def _tiered(fields: Fields | None) -> bool:
        return fields is not None and any("service_tier" in f for f in fields.values())

    def _weight(self, tenant: str) -> int:
        spec = self.tenants.get(tenant)
        return spec.weight if spec is not None else 1

    async def startup(self, runtime: Runtime) -> None:
        providers = runtime.upstreams.providers
        for backend, capacity in self.section.backends.items():
            self.gates[backend] = Gate(
                backend,
                capacity.max_in_flight,
                providers[backend].in_service,
                len(self.classes),
                self._weight,
                capacity.max_queue,
                capacity.reserved,
                capacity.engine_preempts,
            )
            if capacity.capacity == "auto":
                kind = runtime.settings.backends[backend].type
                reader = Reader(self.gates[backend], kind, providers[backend], capacity.max_in_flight, capacity.poll_s)
                self.readers.append(reader)
        meter = runtime.meter
        self.shed = meter.counter(
            "sluice_admission_shed_total",
            "Requests refused by the admission stage: predicted TTFT over the class's SLO (predicted), waited "
            "past it (waited), or the gateway's queue full (queue_full).",
            ("backend", LABEL, "reason"),
        )
        self.queued = meter.counter(
            "sluice_admission_queued_total",
            "Requests that waited at the gateway for a slot of a saturated backend.",
            ("backend", LABEL),
        )
        self.waiting = meter.gauge(
            "sluice_admission_waiting",
            "Requests waiting now at the gateway for a slot of a saturated backend.",
            ("backend", LABEL),
        )
        self.queue_seconds = meter.counter(
            "sluice_admission_queue_seconds_total",
            "Time requests waited at the gateway for a slot (divide by sluice_admission_queued_total: mean wait).",
            ("backend", LABEL),
        )
        if self.readers:
            reported = meter.gauge(
                "sluice_admission_capacity",
                "A backend's capacity as its engines report it (capacity: auto): requests at once, every endpoint.",
                ("backend",),
            )
            for reader in self.readers:
                reader.gauge = reported.labels(reader.gate.backend)
                reader.start()

    async def shutdown(self) -> None:
        for reader in self.readers:
            await reader.stop()

    def classify(self, ex: Exchange) -> Class:
        """The request's class: asked for, within what its tenant may use; else its tenant's default."""
        spec = self.tenants.get(ex.tenant, self.anyone)
        if ex.json.get("background") is True:
            return self.background
        asked = ex.header(HEADER)
        return spec.default if asked is None else self._asked(ex, spec, asked)

    def _asked(self, ex: Exchange, spec: TenantClasses, asked: bytes) -> Class:
        wanted = self.by_name.get(asked.strip().lower())
        if wanted is None:
            raise errors.BadRequestError(
                f"x-sluice-priority: unknown class {asked.decode('latin-1')!r}; the classes are "
                + ", ".join(c.name for c in self.classes),
                param="x-sluice-priority",
                code="unknown_priority",
            )
        if wanted.rank >= spec.highest.rank:
            return wanted
        if self.refuse:
            raise errors.PermissionDeniedError(
                f"x-sluice-priority: tenant {ex.tenant!r} may not ask for class {wanted.name!r}; "
                f"its highest is {spec.highest.name!r}",
                param="x-sluice-priority",
                code="priority_not_allowed",
            )
        return spec.highest

    def on_request(self, ex: Exchange) -> Awaitable[None] | None:
        # The common case written out (a plain request, its tenant's class, a gate with room): it runs for
        # every request, so it reads each thing once; a plain method, whose answer is a coroutine only when the
        # request must wait (the pipeline awaits it then).
        background = ex.json.get("background") is True
        asked = ex.header(HEADER)
        if background:
            cls = self.background
        elif asked is None:
            cls = self.tenants.get(ex.tenant, self.anyone).default
        else:
            cls = self._asked(ex, self.tenants.get(ex.tenant, self.anyone), asked)
        ex.labels[LABEL] = cls.name
        fields = self.fields[cls.rank]
        if fields is not None and ex.endpoint in PROPAGATED:
            ex.upstream_fields = fields
            ex.add_response_headers([(HEADER, cls.label)])
        elif asked is not None:
            ex.add_response_headers([(HEADER, cls.label)])  # it may have been clamped
        targets = ex.targets
        if background or ex.resource or not targets:
            return None  # a background job's start, or a stored object's operation: nothing runs upstream now
        gate = self.gates.get(targets[0].backend)
        if gate is None:
            return None
        if gate.preempts and not cls.rank:
            ex.route_bias = gate.bias  # to the replica running the fewest of its class, which it cannot preempt
        if gate.inflight < gate.limits[cls.rank] and not gate.waiting:  # Gate.enter, inline
            gate.inflight += 1
            ex.state[NAME] = gate  # through at once: its slot held from the request's start (see on_complete)
            return None
        if gate.past(cls.rank):
            ex.state[NAME] = (gate, time.perf_counter() - ex.started, True)
            return None
        if cls.spill and self._spill(ex, gate, cls):
            return None
        return self._queue(ex, gate, cls)

    def _spill(self, ex: Exchange, saturated: Gate, cls: Class) -> bool:
        """Serve from the first fallback with room rather than wait for the saturated primary."""
        targets = ex.targets
        for index in range(1, len(targets)):
            target = targets[index]
            if target.backend == saturated.backend:
                continue
            gate = self.gates.get(target.backend)
            if gate is not None:
                if not (gate.inflight < gate.limits[cls.rank] and not gate.waiting):
                    continue
                gate.inflight += 1
                ex.state[NAME] = gate
            ex.targets = [target, *targets[:index], *targets[index + 1 :]]
            ex.fallback = "overload"
            return True
        return False

    async def _queue(self, ex: Exchange, gate: Gate, cls: Class) -> None:
        predicted = gate.predicted_s(cls.rank)
        if cls.sheddable and predicted > cls.slo_s:
            raise self._shed(gate, cls, "predicted", predicted)
        began = time.perf_counter()
        gauge = self.waiting.labels(gate.backend, cls.name) if self.waiting is not None else None
        if gauge is not None:
            gauge.inc()
        try:
            if cls.sheddable:
                async with asyncio.timeout(cls.slo_s):
                    await gate.wait(ex.tenant, cls.rank)
            else:
                await gate.wait(ex.tenant, cls.rank)
        except Full:
            raise self._shed(gate, cls, "queue_full", predicted) from None
        except TimeoutError:
            ex.upstream_ms += (time.perf_counter() - began) * 1000.0  # waiting is not the gateway's own time
            raise self._shed(gate, cls, "waited", gate.predicted_s(cls.rank)) from None
        finally:
            if gauge is not None:
                gauge.dec()
        now = time.perf_counter()
        ex.state[NAME] = (gate, now - ex.started, False)
        waited = now - began
        # Waiting for a backend's capacity is not the gateway's own work: it counts with the upstream's time.
        ex.upstream_ms += waited * 1000.0
        ex.attributes[QUEUE_MS] = round(waited * 1000.0, 3)
        if ex.upstream_fields is None and ex.header(HEADER) is None:
            ex.add_response_headers([(HEADER, cls.label)])  # it waited: say for which class's turn
        if self.queued is not None:
            self.queued.labels(gate.backend, cls.name).inc()
            self.queue_seconds.labels(gate.backend, cls.name).inc(waited)

    def _shed(self, gate: Gate, cls: Class, reason: str, predicted: float) -> errors.GatewayError:
        if self.shed is not None:
            self.shed.labels(gate.backend, cls.name, reason).inc()
        # When to come back: once the queue ahead has drained to what the SLO allows.
        retry = max(1.0, predicted - cls.slo_s) if predicted > 0 else 1.0
        if reason == "queue_full":
            why = f"its queue at the gateway is full ({gate.max_queue} waiting)"
        elif reason == "waited":
            why = f"a {cls.name!r} request waited {cls.slo_s:g} s, its class's TTFT objective, without a slot"
        else:
            why = (
                f"a {cls.name!r} request would wait about {predicted:.1f} s for its first token, over its "
                f"class's objective of {cls.slo_s:g} s"
            )
        error = errors.ServiceUnavailableError(
            f"backend {gate.backend!r} is saturated: {why}. Please retry after {math.ceil(retry)} s.",
            code="priority_shed",
            headers=[(b"retry-after", str(math.ceil(retry)).encode()), (b"retry-after-ms", b"%d" % (retry * 1000))],
        )
        error.type = "overloaded_error"
        return error

    async def on_response(self, ex: Exchange, head: ResponseHead) -> Tap | None:
        # The service tier that served, where the class asked for one (idle without such a class); the class
        # itself went into the head from on_request.
        fields = ex.upstream_fields
        served = ex.served
        if fields is None or served is None:
            return None
        tier = fields.get(served.backend, {}).get("service_tier")
        if tier is None:
            return None
        head.headers.append((TIER_HEADER, tier.encode()))
        return None if ex.stream else served_tier(head, len(head.headers) - 1)

    def on_complete(self, ex: Exchange, outcome: Outcome) -> None:
        # A plain method (no coroutine a request): it never waits. The state is the gate, for a request through
        # at once, whose slot counts as held from the request's start (the stages before this one take tens of
        # microseconds, the slot is held for the whole answer: no clock is read for it); or (the gate, when the
        # slot was taken in seconds since the start, whether it passed the full gate as the engine preempts).
        held: Gate | tuple[Gate, float, bool] | None = ex.state.pop(NAME, None)
        if held is None:
            return
        if isinstance(held, tuple):
            gate, since, over = held
        else:
            gate, since, over = held, 0.0, False
        if ex.route_bias is not None:
            gate.bias.ended(ex)
        status = outcome.status
        if status >= 400 or status == 0:
            gate.leave_now(over)  # a failure says nothing of how long the backend takes to serve
            return
        total_ms = outcome.total_ms if outcome.total_ms > 0 else (time.perf_counter() - ex.started) * 1000.0
        ttft = outcome.ttft_ms
        gate.leave(total_ms / 1000.0 - since, None if ttft is None else ttft / 1000.0 - since, over)
