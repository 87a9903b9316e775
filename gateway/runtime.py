"""Runtime: everything one gateway process holds, built once at start-up and closed at shutdown."""

from __future__ import annotations

import logging
import threading
import time

from gateway.messages.api import Messages
from gateway.pipeline import Pipeline
from gateway.plugin import Plugin, hooks, load_class
from gateway.responses.api import Responses
from gateway.responses.sockets import Sockets
from gateway.server.collector import Collector
from gateway.server.intake import Intake
from gateway.settings import Settings
from gateway.state.resp import parse_url
from gateway.state.store import Store, StoreUnavailable
from gateway.telemetry import tracecontext
from gateway.telemetry.recorder import Telemetry
from gateway.upstream.attempts import Upstreams
from gateway.upstream.warmup import Warmup

log = logging.getLogger("sluice")


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self.created = time.monotonic()
        self.settings = settings
        self.upstreams = Upstreams(settings)
        # One Redis client per process, shared by every plugin that keeps state across processes.
        redis = settings.redis
        self.store = Store(redis.url, timeout_s=redis.timeout_ms / 1000) if redis.url else None
        # Stored objects' owners and background jobs fail closed: they wait longer, on connections of their own.
        self.decisions = self.store.decisions(redis.decision_timeout_ms / 1000) if self.store else None
        self.plugins: list[Plugin] = [
            load_class(spec)(settings.plugin_config(spec), settings) for spec in settings.plugins
        ]
        self.telemetry = Telemetry(settings, self.plugins, self.store, self.upstreams)
        self.meter = self.telemetry.meter  # plugins make their own series with it at start-up
        self.upstreams.instrument(self.meter)
        self.warmup = Warmup(settings, self.upstreams, self.meter)
        self.responses = Responses(settings, self.upstreams, self.decisions)
        responses = self.responses
        self.pipeline = Pipeline(
            settings, self.upstreams, self.plugins, self.telemetry, responses.admit, responses.stored.dispatch
        )
        # Step 1 of every front door; the Responses API's routing step picks its capable backends.
        self.intake = Intake(
            self.upstreams,
            settings.limits.max_body_bytes,
            self.pipeline.serve,
            responses.route,
            self.telemetry,
            self.pipeline.access,
        )
        self.messages = Messages(settings, self.upstreams)  # Anthropic's Messages API: a door of the intake's
        self.sockets = Sockets(settings, self.pipeline, self.intake, self.meter)  # the Responses API's WebSocket mode
        self.collector = Collector(lambda: self.pipeline.busy)
        self.started = False

    async def start(self) -> None:
        """Warm every backend (each bounded by its connect timeout), start the plugins, say what came up."""
        await self.telemetry.start()
        await self.upstreams.start()
        for _, startup in hooks(self.plugins, "startup"):
            await startup(self)
        await self.warmup.start()  # attempted before ready; ready whatever came of it (it is logged)
        redis = await self._redis_state()
        await self.responses.start()
        # Last: everything built so far lives as long as the process. The collector's schedule is the process's
        # to set: only a gateway that runs the main thread (`sluice serve`, its workers) sets it; one run in a
        # thread of another program (an embedding, the tests) leaves that program's own.
        if threading.current_thread() is threading.main_thread():
            self.collector.start()
        self.started = True
        self._summary(redis)

    @property
    def ready(self) -> bool:
        # Ready once every warm-up was attempted, whatever came of it: a backend that is down is routed
        # around and retried in the background, and taking this pod out of rotation would not bring it back.
        return self.started and self.upstreams.ready

    async def _redis_state(self) -> str:
        if self.store is None:
            return "not configured"
        place = _redis_place(self.settings.redis.url)
        try:
            await self.store.execute("PING")
        except StoreUnavailable as exc:
            return f"{place} unreachable ({exc}); running on in-process state until it is back"
        return f"{place} reachable"

    def _summary(self, redis: str) -> None:
        settings = self.settings
        source = settings.source
        log.info("config: %s", source)
        for name, provider in self.upstreams.providers.items():
            backend = settings.backends[name]
            health = provider.health
            if backend.type == "simulated":
                log.info("backend %s (simulated, in-process): up", name)
                continue
            state = f"down: {health.error}" if health.down else f"{health.state}, {health.warm} warm connection(s)"
            where = backend.base_url or ", ".join(backend.endpoints or [])
            if backend.discovery is not None:
                found = backend.discovery
                where = f"DNS {found.dns}:{found.port}, every {found.interval_s:g} s"
            log.info("backend %s (%s, %s): %s", name, backend.type, where, state)
        for model, chain in self.upstreams.chains.items():
            first = chain[0]
            fallback = ", fallback " + ", ".join(t.model for t in chain[1:]) if len(chain) > 1 else ""
            log.info("model %s -> %s/%s%s", model, first.backend, first.upstream_model, fallback)
        log.info("plugins: %s", ", ".join(settings.plugins) or "none")
        log.info("redis: %s", redis)
        log.info("tracing: %s", tracecontext.describe(settings.telemetry))
        log.info("listening on http://%s:%d", settings.listen.host, settings.listen.port)

    async def aclose(self) -> None:
        self.collector.close()
        cut = await self.pipeline.drain()
        if cut:
            log.warning(
                "shutdown: %d request(s) still running after shutdown.grace_s (%g s) ended with an error event",
                cut,
                self.settings.shutdown.grace_s,
            )
        for name, shutdown in reversed(hooks(self.plugins, "shutdown")):
            try:
                await shutdown()
            except Exception:
                log.exception("plugin %s: shutdown failed", name)
        await self.sockets.aclose()
        await self.responses.aclose()
        await self.warmup.aclose()
        await self.upstreams.aclose()
        if self.store is not None:
            await self.store.aclose()
        if self.decisions is not None:
            await self.decisions.aclose()
        self.telemetry.close()  # flushes queued spans, bounded: a collector that is down does not hold up exit


def _redis_place(url: str) -> str:
    """host:port/db of a Redis URL (every seed of a cluster), without its credentials."""
    addresses, options, cluster = parse_url(url)
    nodes = ", ".join(f"{host}:{port}" for host, port in addresses)
    return f"cluster {nodes}" if cluster else f"{nodes}/{options.db}"
