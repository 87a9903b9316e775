"""Runtime: everything one gateway process holds, built once at start-up and closed at shutdown."""

from __future__ import annotations

import logging

from gateway.pipeline import Pipeline
from gateway.plugin import Plugin, hooks, load_class
from gateway.settings import Settings
from gateway.store import Store
from gateway.telemetry import Telemetry
from gateway.upstream import Upstreams

log = logging.getLogger("sluice")


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.upstreams = Upstreams(settings)
        # One Redis client per process, shared by every plugin that keeps state across processes.
        self.store = Store(settings.redis.url) if settings.redis.url else None
        self.plugins: list[Plugin] = [
            load_class(spec)(settings.plugin_config(spec), settings) for spec in settings.plugins
        ]
        self.telemetry = Telemetry(settings, self.plugins, self.store)
        self.meter = self.telemetry.meter  # plugins make their own series with it at start-up
        self.upstreams.instrument(self.meter)
        self.pipeline = Pipeline(settings, self.upstreams, self.plugins, self.telemetry)
        self.started = False

    async def start(self) -> None:
        self.telemetry.start()
        await self.upstreams.start()
        for _, startup in hooks(self.plugins, "startup"):
            await startup(self)
        self.started = True

    @property
    def ready(self) -> bool:
        return self.started and self.upstreams.ready

    async def aclose(self) -> None:
        for name, shutdown in reversed(hooks(self.plugins, "shutdown")):
            try:
                await shutdown()
            except Exception:
                log.exception("plugin %s: shutdown failed", name)
        await self.upstreams.aclose()
        if self.store is not None:
            await self.store.aclose()
        self.telemetry.close()  # flushes queued spans, bounded: a collector that is down does not hold up exit
