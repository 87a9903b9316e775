"""Plugins that misbehave on purpose, loaded by name ("tests.support.plugins:Broken") like any other."""

from __future__ import annotations

from typing import ClassVar

from gateway.context import Exchange
from gateway.settings import Settings


class Broken:
    """Raises a plain exception (a bug) on requests whose last message says "break"."""

    name: ClassVar[str] = "broken"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    async def on_request(self, ex: Exchange) -> None:
        if ex.json["messages"][-1].get("content") == "break":
            raise RuntimeError("a bug")
