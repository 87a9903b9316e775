"""The slo plugin's policy: each model's window and state, the hedge budget, and the hooks (see __init__)."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from gateway.plugin import Configured, Empty, Problem, Schema
from gateway.telemetry.quantiles import percentile
from plugins.slo.config import SloModel, SloSettings

if TYPE_CHECKING:
    from gateway.context import Exchange
    from gateway.plugin import Outcome
    from gateway.runtime import Runtime
    from gateway.settings import Settings

log = logging.getLogger("sluice.slo")

HEALTHY, DEGRADED = "healthy", "degraded"
MAX_SAMPLES = 4096  # per window: bounds memory and the cost of a p95 whatever the traffic
FAILURES = frozenset({408, 429, 500, 502, 503, 504})
EVALUATE_EVERY_S = 0.2
HEDGE_WINDOW_S = 60.0


Config = Configured[Empty, SloModel, Empty]


class Window:
    """(time, ttft_ms or None, failed) samples of the last `span_s` seconds."""

    __slots__ = ("failed", "samples", "span_s", "timed")

    def __init__(self, span_s: float) -> None:
        self.span_s = span_s
        self.samples: deque[tuple[float, float | None, bool]] = deque(maxlen=MAX_SAMPLES)
        # Of the samples held: those that failed and those with a TTFT, kept as they come and go, so that an
        # evaluation scans the window only for TTFTs, and only when there are some (streams give them).
        self.failed = 0
        self.timed = 0

    def add(self, now: float, ttft_ms: float | None, failed: bool) -> None:
        samples = self.samples
        if len(samples) == MAX_SAMPLES:
            self._forget(samples[0])  # the append drops it
        samples.append((now, ttft_ms, failed))
        if failed:
            self.failed += 1
        if ttft_ms is not None:
            self.timed += 1

    def _forget(self, sample: tuple[float, float | None, bool]) -> None:
        if sample[2]:
            self.failed -= 1
        if sample[1] is not None:
            self.timed -= 1

    def stats(self, now: float) -> tuple[int, float, float]:
        """(samples, p95 TTFT in ms, error rate) over the window."""
        cutoff = now - self.span_s
        samples = self.samples
        while samples and samples[0][0] < cutoff:
            self._forget(samples.popleft())
        if not samples:
            return 0, 0.0, 0.0
        p95 = percentile([t for _, t, _ in samples if t is not None], 0.95) if self.timed else 0.0
        return len(samples), p95, self.failed / len(samples)


class ModelSlo:
    __slots__ = (
        "dirty",
        "evaluated",
        "model",
        "moved",
        "probes",
        "requests",
        "since",
        "spec",
        "state",
        "transitions",
        "window",
    )

    def __init__(self, model: str, spec: SloSettings, moved: Callable[[str, str, str], None] | None = None) -> None:
        self.model = model
        self.moved = moved  # (model, from state, to state), on every transition
        self.spec = spec
        self.state = HEALTHY
        self.since = 0.0
        self.window = Window(spec.window_s)
        self.probes = Window(max(spec.window_s, spec.cooldown_s))
        self.requests = 0
        self.transitions = 0
        self.evaluated = 0.0
        self.dirty = False  # samples arrived since the last evaluation

    def is_probe(self) -> bool:
        """Whether this request, while degraded, should try the primary: an exact `probe_ratio` share."""
        self.requests += 1
        ratio = self.spec.probe_ratio
        return int(self.requests * ratio) != int((self.requests - 1) * ratio)

    def record(self, now: float, ttft_ms: float | None, failed: bool) -> None:
        (self.probes if self.state == DEGRADED else self.window).add(now, ttft_ms, failed)
        self.dirty = True
        self.maybe_evaluate(now)

    def maybe_evaluate(self, now: float) -> None:
        """Evaluate at most every EVALUATE_EVERY_S (a p95 sorts the window), but never leave samples unjudged:
        requests call this too, so a burst of slow samples is judged by the next request, not the next sample."""
        if self.dirty and (now - self.evaluated >= EVALUATE_EVERY_S or self.state == DEGRADED):
            self.evaluated = now
            self.dirty = False
            self.evaluate(now)

    def evaluate(self, now: float) -> None:
        spec = self.spec
        if self.state == HEALTHY:
            count, p95, errors = self.window.stats(now)
            if count >= spec.min_samples and (p95 > spec.ttft_p95_ms or errors > spec.max_error_rate):
                self._move(DEGRADED, now, f"p95 TTFT {p95:.0f} ms, error rate {errors:.1%} over {count} samples")
            return
        if now - self.since < spec.cooldown_s:
            return
        recent = list(self.probes.samples)[-spec.recovery_samples :]
        if len(recent) < spec.recovery_samples:
            return
        limit = spec.ttft_p95_ms * spec.recovery_margin
        if all(not failed and ttft is not None and ttft <= limit for _, ttft, failed in recent):
            self._move(HEALTHY, now, f"{len(recent)} probes in a row under {limit:.0f} ms")

    def _move(self, state: str, now: float, why: str) -> None:
        if self.moved is not None:
            self.moved(self.model, self.state, state)
        self.state = state
        self.since = now
        self.transitions += 1
        self.window = Window(self.spec.window_s)
        self.probes = Window(max(self.spec.window_s, self.spec.cooldown_s))
        if state == DEGRADED:
            log.warning("model %s degraded (%s): routing to its fallback", self.model, why)
        else:
            log.warning("model %s recovered (%s): routing to it again", self.model, why)


class HedgeBudget:
    """A tenant's hedged requests may be at most `ratio` of its requests in the last minute."""

    __slots__ = ("granted", "hedged", "ratio", "requests", "started")

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self.started = 0.0
        self.requests = 0
        self.hedged = 0
        self.granted = 0  # in flight with the right to hedge: counted as hedged until they end

    def grant(self, now: float) -> bool:
        if now - self.started > HEDGE_WINDOW_S:
            self.started, self.requests, self.hedged = now, 0, 0
        self.requests += 1
        # One hedge is allowed from the start, so that a first slow request can be raced at all.
        if self.ratio == 0 or self.hedged + self.granted >= max(1.0, self.ratio * self.requests):
            return False
        self.granted += 1
        return True

    def settle(self, hedged: bool) -> None:
        self.granted -= 1
        self.hedged += hedged


class Slo:
    name: ClassVar[str] = "slo"
    schema: ClassVar[Schema] = Schema(model=SloModel)

    @classmethod
    def check(cls, config: Config, settings: Settings, listed: Sequence[str]) -> Iterable[Problem]:
        for name, spec in config.models.items():
            if settings.models[name].fallback:
                continue
            if spec.slo is not None:
                yield f"models.{name}.slo", f"an SLO needs a fallback to degrade to (set models.{name}.fallback)"
            if spec.hedge_after_ms is not None:
                yield f"models.{name}.hedge_after_ms", f"hedging needs a fallback to race (set models.{name}.fallback)"

    def __init__(self, config: Config, settings: Settings) -> None:
        self.models = {
            name: ModelSlo(name, spec.slo, self._moved) for name, spec in config.models.items() if spec.slo is not None
        }
        self.hedging = {
            name: (spec.hedge_after_ms, spec.max_hedge_ratio)
            for name, spec in config.models.items()
            if spec.hedge_after_ms is not None
        }
        self.budgets: dict[tuple[str, str], HedgeBudget] = {}
        self.gauge: Any = None

    async def startup(self, runtime: Runtime) -> None:
        if self.models:
            self.gauge = runtime.meter.gauge(
                "sluice_slo_state",
                "1 for the state each model is in (summed over worker processes), 0 for the others.",
                ("model", "state"),
            )
            for name, slo in self.models.items():
                self.gauge.labels(name, slo.state).set(1)

    def states(self) -> dict[str, str]:
        return {name: slo.state for name, slo in self.models.items()}

    def _moved(self, model: str, before: str, after: str) -> None:
        if self.gauge is not None:
            self.gauge.labels(model, before).set(0)
            self.gauge.labels(model, after).set(1)

    async def on_request(self, ex: Exchange) -> None:
        slo = self.models.get(ex.model)
        if slo is not None:
            if slo.dirty:
                slo.maybe_evaluate(time.monotonic())
            ex.attributes["sluice.slo.state"] = slo.state
            if slo.state == DEGRADED and not slo.is_probe() and len(ex.targets) > 1:
                ex.targets = [*ex.targets[1:], ex.targets[0]]
                ex.fallback = "slo"
        hedge = self.hedging.get(ex.model)
        if hedge is not None and ex.stream and ex.fallback is None:
            after_ms, ratio = hedge
            key = (ex.tenant, ex.model)
            budget = self.budgets.get(key)
            if budget is None:
                budget = self.budgets[key] = HedgeBudget(ratio)
            if budget.grant(time.monotonic()):
                ex.hedge_after_ms = after_ms
                ex.state["hedge"] = budget

    def on_complete(self, ex: Exchange, outcome: Outcome) -> None:
        budget = ex.state.get("hedge")
        if isinstance(budget, HedgeBudget):
            budget.settle(ex.hedged)
        if not self.models or ex.resource:  # a stored response's retrieval says nothing about the model
            return
        now = time.monotonic()
        for model, _, status in ex.attempts:
            slo = self.models.get(model)
            if slo is None:
                continue
            if status:
                if status in FAILURES:
                    slo.record(now, None, True)
                continue
            broke = outcome.error is not None and not outcome.client_gone and not outcome.complete
            slo.record(now, outcome.ttft_ms if ex.stream else None, broke)
