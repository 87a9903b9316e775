"""cascade: the small model first, the larger one when the small answer fails its checks.

Opt-in per model (`models.NAME.cascade`, config.py). A whole (non-streamed) chat completion for such a model
is first sent to its `small` model; the answer is judged by the configured checks (checks.py). One that passes
is the answer (`x-sluice-cascade: small`). One that fails, or a small model that fails or does not answer in
time, is escalated:

- `mode: escalate`: the request goes at once to the model's own targets (its fallbacks included), all of it
  within `max_total_ms` of the request's arrival. Past that bound the small answer is served as it is
  (`x-sluice-cascade: kept`), or a 504 when there is none.
- `mode: async`: the small answer goes back now (`x-sluice-cascade: async`) and a background job (the
  gateway's own, gateway/jobs/background.py) runs the request on the larger model; its id is in
  `x-sluice-cascade-job`, its result at `GET /v1/sluice/background/{id}` for the same tenant.

`x-sluice-model` names the model whose answer was served; `x-sluice-cascade-reason` the check that failed.
Every request it handles counts in `sluice_cascade_total{model, outcome, reason}` and carries the span
attributes `sluice.cascade`, `sluice.cascade_reason` and, for async, `sluice.cascade_job`.

It calls the upstreams itself (a hook may answer with a Reply), so that the bound holds over both calls and
the small path costs no more than the check. Listed after admission when both are: the request's class and
its priority fields go to both models. Its answers are not cached by the cache plugins (they store what
upstreams answered through the pipeline only).

Imports: the core (gateway.*) only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import orjson

from gateway import errors
from gateway.plugin import Configured, Empty, Problem, Reply, Schema
from gateway.server.relay import find_usage
from gateway.state.store import StoreUnavailable
from plugins.cascade.checks import verdict, without_logprobs
from plugins.cascade.config import CascadeModel, CascadeSpec

if TYPE_CHECKING:
    from gateway.context import Exchange, Target
    from gateway.runtime import Runtime
    from gateway.settings import Settings
    from gateway.upstream.attempts import Opened, Upstreams

__all__ = ["Cascade"]

NAME = "cascade"
HEADER = b"x-sluice-cascade"
REASON_HEADER = b"x-sluice-cascade-reason"
JOB_HEADER = b"x-sluice-cascade-job"
JSON = (b"content-type", b"application/json")
Config = Configured[Empty, CascadeModel, Empty]
log = logging.getLogger("sluice.cascade")


class Cascade:
    name: ClassVar[str] = NAME
    # After whatever may answer or refuse first (a cache hit never reaches a model), and after admission: the
    # request's class is set before either model is called.
    schema: ClassVar[Schema] = Schema(
        model=CascadeModel, after=("auth", "rate_limit", "cache", "semantic_cache", "slo", "admission")
    )

    @classmethod
    def check(cls, config: Config, settings: Settings, listed: Sequence[str]) -> Iterable[Problem]:
        for name, part in config.models.items():
            spec = part.cascade
            if spec is None:
                continue
            if spec.small == name:
                yield f"models.{name}.cascade.small", "the small model must be another model"
            elif spec.small not in settings.models:
                yield f"models.{name}.cascade.small", f"no model named {spec.small!r}"

    def __init__(self, config: Config, settings: Settings) -> None:
        self.specs = {name: part.cascade for name, part in config.models.items() if part.cascade is not None}
        self.upstreams: Upstreams | None = None
        self.chains: dict[str, tuple[Target, ...]] = {}
        self.starters: dict[str, Target] = {}
        self.counter: Any = None
        self.series: dict[tuple[str, str, str], Any] = {}  # the counter's children, found once each

    async def startup(self, runtime: Runtime) -> None:
        self.upstreams = runtime.upstreams
        self.chains = {name: runtime.upstreams.chains[spec.small] for name, spec in self.specs.items()}
        later = [name for name, spec in self.specs.items() if spec.mode == "async"]
        if later:  # the background jobs' starters of the larger models (gateway/responses/api.py)
            starters = runtime.responses.starters
            self.starters = {name: starters[("chat/completions", name)] for name in later}
        self.counter = runtime.meter.counter(
            "sluice_cascade_total",
            "Requests answered small model first, by outcome (small: its answer passed; escalated: the larger "
            "model answered; async: the small answer now, the larger in a background job; kept: the escalation "
            "failed or ran out of time, the small answer served) and the check that failed.",
            ("model", "outcome", "reason"),
        )

    async def on_request(self, ex: Exchange) -> Reply | None:
        spec = self.specs.get(ex.model)
        if spec is None or ex.stream or ex.endpoint != "chat/completions" or ex.resource:
            return None
        if ex.json.get("background") is True:
            return None  # a background job: the larger model, with no one waiting
        deadline = ex.started + spec.max_total_ms / 1000.0
        targets = ex.targets
        document, reason = await self._small(ex, spec, deadline)
        if reason is None:
            assert document is not None
            return self._reply(ex, "small", None, document)
        if spec.mode == "async" and document is not None:
            return await self._later(ex, reason, document)
        ex.targets = targets
        return await self._escalate(ex, spec, reason, document, deadline)

    async def _small(self, ex: Exchange, spec: CascadeSpec, deadline: float) -> tuple[bytes | None, str | None]:
        """The small model's answer (None when it gave none) and the check it failed (None: it passed)."""
        assert self.upstreams is not None
        ex.targets = list(self.chains[ex.model])
        asked = spec.min_mean_logprob is not None and ex.json.get("logprobs") is not True
        body, data = ex.body, ex.json
        if asked:  # its confidence is judged by its logprobs: asked for on the client's behalf
            ex.json = {**data, "logprobs": True}
            ex.body = orjson.dumps(ex.json)
        try:
            opened = await self._within(ex, deadline)
        except TimeoutError:
            return None, "timeout"
        except errors.GatewayError as exc:
            return None, f"error_{exc.status}"
        finally:
            ex.body, ex.json = body, data
        whole = opened.first
        try:
            document = orjson.loads(whole)
        except orjson.JSONDecodeError:
            self._spent(ex, find_usage(whole[-2048:]))
            return None, "invalid"
        self._spent(ex, document.get("usage") if isinstance(document, dict) else None)
        reason = verdict(document, ex.json, spec)
        if asked:  # served as it is when passed, kept or answered now with a job: never with what it did not ask
            whole = without_logprobs(document)
        return whole, reason

    async def _within(self, ex: Exchange, deadline: float) -> Opened:
        """`upstreams.open(ex)`, cancelled at `deadline` (perf_counter) with a TimeoutError.

        A bare timer on the loop rather than `asyncio.timeout`, which costs twice as much on the path every
        small answer takes; the request's own cancellation (the client left) still goes through as such.
        """
        assert self.upstreams is not None
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        expired: list[bool] = []

        def expire() -> None:
            expired.append(True)
            task.cancel()

        timer = loop.call_at(loop.time() + deadline - time.perf_counter(), expire)
        try:
            return await self.upstreams.open(ex)
        except asyncio.CancelledError:
            if expired and task.uncancel() == 0:
                raise TimeoutError from None
            raise
        finally:
            timer.cancel()

    async def _escalate(
        self, ex: Exchange, spec: CascadeSpec, reason: str, small: bytes | None, deadline: float
    ) -> Reply:
        """The larger model's answer, within what is left of the bound; else the small one as it is."""
        assert self.upstreams is not None
        failure: errors.GatewayError
        try:
            opened = await self._within(ex, deadline)
            self._spent(ex, find_usage(opened.first[-2048:]))
            return self._reply(ex, "escalated", reason, opened.first)
        except TimeoutError:
            failure = errors.UpstreamTimeoutError(
                f"model {ex.model!r}: no answer within cascade.max_total_ms ({spec.max_total_ms:g} ms)",
                code="cascade_timeout",
            )
        except errors.GatewayError as exc:
            failure = exc
        if small is None:
            self._count(ex, "failed", reason)
            raise failure
        log.info("request %s: escalation failed (%s), the small answer served", ex.request_id, failure.message)
        return self._reply(ex, "kept", reason, small)

    async def _later(self, ex: Exchange, reason: str, small: bytes) -> Reply:
        """The small answer now; the larger model's in a background job the client can read."""
        starter = self.starters[ex.model]
        served = ex.served
        try:
            job = await starter.provider.send(ex, starter)
            ident = orjson.loads(await job.read())["id"]
        except (errors.GatewayError, StoreUnavailable) as exc:  # the job store down, the tenant at its cap of jobs
            log.info("request %s: no background job for the larger model (%s)", ex.request_id, exc)
            return self._reply(ex, "kept", reason, small)
        finally:
            ex.served = served
        ex.attributes["sluice.cascade_job"] = ident
        reply = self._reply(ex, "async", reason, small)
        reply.headers.append((JOB_HEADER, ident.encode()))
        return reply

    def _reply(self, ex: Exchange, outcome: str, reason: str | None, body: bytes) -> Reply:
        self._count(ex, outcome, reason)
        headers = [JSON, (HEADER, outcome.encode())]
        if reason is not None:
            headers.append((REASON_HEADER, reason.encode()))
        return Reply(200, headers, body, source=NAME, usage=ex.state.pop(NAME, None))

    @staticmethod
    def _spent(ex: Exchange, usage: Any) -> None:
        """Add an answer's usage to the request's: both models' tokens count (the rate limiter, the metrics)."""
        if not isinstance(usage, dict):
            return
        total = ex.state.get(NAME)
        if total is None:
            ex.state[NAME] = {k: usage.get(k, 0) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
            return
        for key in total:
            value = usage.get(key)
            if type(value) is int:
                total[key] += value

    def _count(self, ex: Exchange, outcome: str, reason: str | None) -> None:
        ex.attributes["sluice.cascade"] = outcome
        if reason is not None:
            ex.attributes["sluice.cascade_reason"] = reason
        if self.counter is not None:
            key = (ex.model, outcome, reason or "")
            series = self.series.get(key)
            if series is None:
                series = self.series[key] = self.counter.labels(*key)
            series.inc()
