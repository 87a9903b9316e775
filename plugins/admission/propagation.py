"""The class, told upstream: vLLM's `priority`, OpenAI's and Azure's `service_tier`, and the tier served.

Built once at start-up: for every class, the fields each backend gets (`ex.upstream_fields`, which the
providers merge into the body they send); a class with nothing to send costs its requests nothing.
OpenAI and Azure answer with the tier that actually served (`"service_tier": "default"` when priority
processing was not available): for a whole answer it replaces the tier asked in `x-sluice-service-tier`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.plugin import ResponseHead, Tap
    from gateway.settings import Settings
    from plugins.admission.config import ClassSpec

TIER_HEADER = b"x-sluice-service-tier"
TIERED = frozenset({"openai", "azure"})  # the kinds that have `service_tier`
# The endpoints whose bodies take the fields (OpenAI refuses `service_tier` on embeddings and legacy completions).
PROPAGATED = frozenset({"chat/completions", "responses"})
SERVED = re.compile(rb'"service_tier"\s*:\s*"([A-Za-z0-9_-]{1,32})"')

Fields = Mapping[str, Mapping[str, Any]]  # backend -> the fields added to its body


def fields_by_class(classes: Sequence[ClassSpec], settings: Settings) -> list[Fields | None]:
    """By rank: what each backend gets for a request of that class; None when no backend gets anything."""
    out: list[Fields | None] = []
    for spec in classes:
        fields: dict[str, dict[str, Any]] = {}
        for name, backend in settings.backends.items():
            if backend.type == "vllm" and spec.vllm_priority is not None:
                fields[name] = {"priority": spec.vllm_priority}
            elif backend.type in TIERED and spec.service_tier is not None:
                fields[name] = {"service_tier": spec.service_tier}
        out.append(fields or None)
    return out


def served_tier(head: ResponseHead, index: int) -> Tap:
    """A tap on a whole answer (called before its head goes out) that puts the tier served in the header."""

    def tap(body: bytes) -> None:
        if body:
            found = SERVED.search(body[-4096:]) or SERVED.search(body)
            if found is not None:
                head.headers[index] = (TIER_HEADER, found.group(1))

    return tap
