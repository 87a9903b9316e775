"""Runtime: everything one gateway process holds, built once at start-up and closed at shutdown."""

from __future__ import annotations

import logging

from gateway.pipeline import Pipeline
from gateway.plugin import Plugin, hooks, load_class
from gateway.settings import Settings
from gateway.upstream import Upstreams

log = logging.getLogger("sluice")


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.upstreams = Upstreams(settings)
        self.plugins: list[Plugin] = [load_class(name)(settings) for name in settings.plugins]
        self.pipeline = Pipeline(settings, self.upstreams, self.plugins)
        self.started = False

    async def start(self) -> None:
        await self.upstreams.start()
        for startup in hooks(self.plugins, "startup"):
            await startup(self)
        self.started = True

    @property
    def ready(self) -> bool:
        return self.started and self.upstreams.ready

    async def aclose(self) -> None:
        for shutdown in reversed(hooks(self.plugins, "shutdown")):
            try:
                await shutdown()
            except Exception:
                log.exception("plugin %s: shutdown failed", shutdown.__self__.name)
        await self.upstreams.aclose()
