"""Warm-up: models answer their first user as fast as their thousandth.

A model's first request on a fresh server pays for what nothing has done yet: CUDA graphs and kernels, the
prompt cache, for Ollama the load of the model itself. Per model, `warmup: {requests: N, ...}` sends N small
requests through its backend (the same warm pool and path as user requests, one after the other) before the
gateway reports ready, bounded by `timeout_s`. The gateway becomes ready after the attempt whatever its result,
which is logged: a backend that is down must not keep the others from serving. The same warm-up runs again
each time a backend comes back: a self-hosted one from `loading` or `down` to `up` (its health path), any
other from `down` to `up` (its connections' state, gateway/upstream/health.py, looked at every second).

`keep_warm_s` keeps a model resident on servers that unload idle models: every `keep_warm_s` it sends the
cheapest request the server allows (Ollama: a load with no prompt, carrying the model's `keep_alive`; other
servers: one warm-up request of `max_tokens` 1).

Backend state changes (gateway/upstream/providers/selfhosted.py) arrive here: they keep `upstreams.loading` (what the
request path routes around) and the `sluice_backend_loading{backend}` gauge.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from gateway.context import Exchange
from gateway.settings import WarmupSettings
from gateway.upstream.connection import PoolError
from gateway.upstream.providers.ollama import OllamaProvider
from gateway.upstream.providers.selfhosted import SelfHostedProvider

if TYPE_CHECKING:
    from gateway.context import Target
    from gateway.settings import Settings
    from gateway.telemetry.metrics import Meter
    from gateway.upstream.attempts import Upstreams
    from gateway.upstream.providers.base import Provider

log = logging.getLogger("sluice.warmup")

DEFAULT = WarmupSettings()  # what a keep-warm ping sends to a model without a warm-up of its own
CAME_BACK = frozenset({"loading", "down"})
CONNECTION_POLL_S = 1.0


class Warmup:
    def __init__(self, settings: Settings, upstreams: Upstreams, meter: Meter) -> None:
        self.upstreams = upstreams
        self.plans: dict[str, WarmupSettings] = {
            model: spec.warmup for model, spec in settings.models.items() if spec.warmup and spec.warmup.requests
        }
        self.keep: dict[str, float] = {
            model: spec.keep_warm_s for model, spec in settings.models.items() if spec.keep_warm_s
        }
        self.loading_gauge: Any = meter.gauge(
            "sluice_backend_loading", "1 while a self-hosted backend is loading its model.", ("backend",)
        )
        self.warmed: dict[str, int] = {}  # model -> warm-up requests that succeeded, over the process's life
        self._tasks: set[asyncio.Task[None]] = set()
        self._started = False
        for name, provider in upstreams.providers.items():
            if isinstance(provider, SelfHostedProvider):
                provider.listeners.append(self._changed)
                self.loading_gauge.labels(name).set(0)

    async def start(self) -> None:
        """Warm every model that asks for it, all at once, each within its own timeout; then keep them warm."""
        self._started = True
        await asyncio.gather(*(self.warm(model, "start-up") for model in self.plans))
        for model, every in self.keep.items():
            self._spawn(self._keep_warm(model, every))
        # Other backends say only whether they can be reached (gateway/upstream/health.py): one that was down and is up
        # again is warmed again too. A flag read a second, off the request path.
        watched = {target.provider for model, target in self.upstreams.targets.items() if model in self.plans} - {
            p for p in self.upstreams.providers.values() if isinstance(p, SelfHostedProvider)
        }
        if watched:
            self._spawn(self._watch_connections(watched))

    async def warm(self, model: str, why: str) -> int:
        """Send the model's warm-up requests; how many succeeded. Never raises: the result is logged."""
        plan = self.plans[model]
        target = self.upstreams.targets[model]
        started = time.perf_counter()
        done = 0
        failure = ""
        try:
            async with asyncio.timeout(plan.timeout_s):
                keep_alive = target.settings.keep_alive
                if isinstance(target.provider, OllamaProvider) and keep_alive is not None:
                    await target.provider.keep_warm(target.upstream_model, keep_alive, plan.timeout_s)
                for _ in range(plan.requests):
                    await self.request(target, plan)
                    done += 1
        except TimeoutError:
            failure = f"no answer within {plan.timeout_s:g} s"
        except (WarmupFailed, PoolError, httpx.HTTPError) as exc:
            failure = str(exc) or type(exc).__name__
        self.warmed[model] = self.warmed.get(model, 0) + done
        ms = (time.perf_counter() - started) * 1000.0
        if failure:
            log.warning(
                "model %s on %s: warm-up (%s) %d/%d in %.0f ms, failed: %s; serving anyway, warm-up again when "
                "the backend comes back",
                model, target.backend, why, done, plan.requests, ms, failure,
            )  # fmt: skip
        else:
            log.info("model %s on %s: warm-up (%s) %d/%d in %.0f ms", model, target.backend, why, done, done, ms)
        return done

    async def request(self, target: Target, plan: WarmupSettings) -> None:
        """One warm-up request through the backend's provider; raises WarmupFailed unless it answers 2xx."""
        if plan.endpoint == "embeddings":
            body: dict[str, Any] = {"model": target.model, "input": plan.prompt}
        elif plan.endpoint == "completions":
            body = {"model": target.model, "prompt": plan.prompt, "max_tokens": plan.max_tokens}
        else:
            body = {"model": target.model, "messages": [{"role": "user", "content": plan.prompt}]}
            body["max_tokens"] = plan.max_tokens
        raw = orjson.dumps(body)
        ex = Exchange(f"warmup-{uuid.uuid4().hex[:16]}", plan.endpoint, [], raw, body, time.perf_counter())
        response = await target.provider.send(ex, target)
        try:
            answer = await response.read()
        finally:
            response.close()
        if response.status >= 300:
            raise WarmupFailed(f"{response.status}: {_excerpt(answer)}")

    def _changed(self, provider: SelfHostedProvider, before: str, after: str) -> None:
        loading = self.upstreams.loading
        if after == "loading":
            loading.add(provider.name)
        else:
            loading.discard(provider.name)
        self.loading_gauge.labels(provider.name).set(1 if after == "loading" else 0)
        if self._started and after == "up" and before in CAME_BACK:
            for model, target in self.upstreams.targets.items():
                if target.provider is provider and model in self.plans:
                    self._spawn(self._rewarm(model, before))

    async def _watch_connections(self, providers: set[Provider]) -> None:
        seen = {provider: provider.health.state for provider in providers}
        while True:
            await asyncio.sleep(CONNECTION_POLL_S)
            for provider, before in seen.items():
                now = seen[provider] = provider.health.state
                if before == "down" and now == "up":
                    for model, target in self.upstreams.targets.items():
                        if target.provider is provider and model in self.plans:
                            self._spawn(self._rewarm(model, "down"))

    async def _rewarm(self, model: str, before: str) -> None:
        await self.warm(model, f"back from {before}")

    async def _keep_warm(self, model: str, every: float) -> None:
        target = self.upstreams.targets[model]
        provider = target.provider
        plan = self.plans.get(model, DEFAULT)
        failing = False
        while True:
            await asyncio.sleep(every)
            if isinstance(provider, SelfHostedProvider) and provider.server != "up":
                continue  # a loading or unreachable server: the state watch brings it back, then the warm-up
            try:
                if isinstance(provider, OllamaProvider):
                    await provider.keep_warm(target.upstream_model, target.settings.keep_alive, plan.timeout_s)
                else:
                    await asyncio.wait_for(self.request(target, plan), plan.timeout_s)
            except (TimeoutError, WarmupFailed, PoolError, httpx.HTTPError) as exc:
                if not failing:
                    log.warning("model %s on %s: keep-warm failed: %s", model, target.backend, exc)
                failing = True
                continue
            if failing:
                log.info("model %s on %s: keep-warm works again", model, target.backend)
            failing = False

    def _spawn(self, job: Any) -> None:
        task = asyncio.get_running_loop().create_task(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task


class WarmupFailed(Exception):
    """A warm-up request was answered with an error status."""


def _excerpt(body: bytes) -> str:
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])[:200]
    return body[:200].decode("utf-8", "replace") or "(no body)"
