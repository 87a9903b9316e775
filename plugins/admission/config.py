"""The admission plugin's config: its priority classes, the backends' capacity, and each tenant's classes.

```yaml
admission:
  classes:                       # highest first: a class is served before every class below it
    - {name: interactive, ttft_slo_ms: 2000, vllm_priority: 0, service_tier: priority}
    - {name: standard, ttft_slo_ms: 5000, sheddable: true}
    - {name: batch, ttft_slo_ms: 60000, sheddable: true, vllm_priority: 10, service_tier: flex}
  default_class: standard        # a tenant that names none (unset: the middle of the list, rounded up)
  background_class: batch        # background jobs (unset: the lowest class)
  above_allowed: clamp           # a header asking above the tenant's max_class: clamp (default) or refuse (403)
  backends:
    vllm: {max_in_flight: 16}    # per endpoint (replica): more waits at the gateway, by class
    sglang: {max_in_flight: 32, engine_preempts: true}   # the top class passes a full gate: the engine makes room
    llama: {max_in_flight: 4, capacity: auto}            # read from the engine (/slots, /metrics); 4 if unreadable
tenants:
  acme: {priority: {class: interactive, max_class: interactive, weight: 3}}
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator, model_validator

from gateway.settings import Strict

HEADER = b"x-sluice-priority"


class ClassSpec(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    # Refused at once (503 + retry-after) when its predicted time to first token exceeds `ttft_slo_ms`, and
    # when it has waited that long in the queue; a class that is not sheddable waits its turn.
    sheddable: bool = False
    ttft_slo_ms: float = Field(5000.0, gt=0)
    # While the primary's backend is saturated, go to the first fallback (`models.NAME.fallback`) whose
    # backend has a free slot, or no gate, rather than wait: `x-sluice-fallback: overload`.
    spill: bool = False
    # Sent upstream as `priority` to vLLM backends (vLLM: lower is served first; the server must run with
    # `--scheduling-policy priority`). None: the field is not sent.
    vllm_priority: int | None = None
    # Sent upstream as `service_tier` to openai and azure backends ("priority", "flex", "default", "auto").
    service_tier: str | None = Field(None, min_length=1, max_length=32)


class BackendCapacity(Strict):
    max_in_flight: int = Field(ge=1)  # per endpoint (replica) in service: the gateway's requests at once
    max_queue: int = Field(1024, ge=0)  # waiting at the gateway for this backend, every class together
    # Of max_in_flight, the slots per endpoint only the highest class may take: it then finds one at once.
    reserved: int = Field(0, ge=0)
    # The engine preempts a running request of a lower priority for a higher one (SGLang with
    # `--enable-priority-scheduling`, vLLM's V0 engine with `--scheduling-policy priority`; not vLLM's V1
    # engine): the highest class is let through a full gate at once, up to the capacity again, and the engine
    # pauses a lower class's request to run it. Its class must send the engine a priority (`vllm_priority`);
    # with several replicas, `routing: least_outstanding` sends it where the fewest of its class run.
    engine_preempts: bool = False
    # `auto`: each endpoint's capacity as its engine reports it (llama.cpp's /slots, vLLM's /metrics), read
    # every `poll_s` in the background; `max_in_flight` where it cannot be read (plugins/admission/capacity.py).
    capacity: Literal["configured", "auto"] = "configured"
    poll_s: float = Field(1.0, gt=0, le=60)

    @model_validator(mode="after")
    def _room_left(self) -> BackendCapacity:
        if self.reserved >= self.max_in_flight:
            raise ValueError(f"reserved ({self.reserved}) must be below max_in_flight ({self.max_in_flight})")
        return self


class AdmissionSection(Strict):
    """`admission:`"""

    classes: list[ClassSpec] = Field(
        default_factory=lambda: [
            ClassSpec(name="interactive", ttft_slo_ms=2000.0),
            ClassSpec(name="standard", ttft_slo_ms=5000.0, sheddable=True),
            ClassSpec(name="batch", ttft_slo_ms=60000.0, sheddable=True),
        ],
        min_length=1,
        max_length=16,
    )
    default_class: str | None = None
    background_class: str | None = None
    above_allowed: Literal["clamp", "refuse"] = "clamp"
    backends: dict[str, BackendCapacity] = Field(default_factory=dict)

    @field_validator("classes")
    @classmethod
    def _unique(cls, classes: list[ClassSpec]) -> list[ClassSpec]:
        names = [c.name for c in classes]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"class {twice[0]!r} is named twice")
        return classes


class TenantPriority(Strict):
    class_: str | None = Field(None, alias="class")  # its requests' class when they ask for none
    max_class: str | None = None  # the highest it may ask for (unset: its own class)
    weight: int = Field(1, ge=1, le=1000)  # its share of turns within a class, against the other tenants


class AdmissionTenant(Strict):
    """Its keys under `tenants.NAME`."""

    priority: TenantPriority = TenantPriority()


@dataclass(frozen=True, slots=True)
class Class:
    """A class as the request path uses it: its rank (0 the highest) and its settings."""

    name: str
    rank: int
    sheddable: bool
    slo_s: float
    label: bytes  # the header's value, encoded once
    spill: bool = False


@dataclass(frozen=True, slots=True)
class TenantClasses:
    """What a tenant may use: its default class and the highest one it may ask for."""

    default: Class
    highest: Class
    weight: int
