"""Plugins built as the runtime builds them, and ones that misbehave on purpose, loaded by name like any other."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, cast

from gateway.context import Exchange
from gateway.plugin import Configured, Schema
from gateway.settings import Settings, Strict, TelemetrySettings
from gateway.telemetry.metrics import Meter, Metrics

if TYPE_CHECKING:
    from gateway.runtime import Runtime
    from gateway.state.store import Store


class Named(Protocol):
    """A plugin class, as far as `make` needs it: the name of its config section."""

    name: ClassVar[str]


P = TypeVar("P", bound=Named)


class GreeterSection(Strict):
    greeting: str = "hi"


class GreeterModel(Strict):
    greet: bool = False


class Greeter:
    """A plugin from outside the gateway's package with sections of its own, top-level and per model."""

    name: ClassVar[str] = "greeter"
    schema: ClassVar[Schema] = Schema(section=GreeterSection, model=GreeterModel)

    def __init__(self, config: Configured[GreeterSection, GreeterModel, Any], settings: Settings) -> None:
        self.config = config


class Broken:
    """Raises a plain exception (a bug) on requests whose last message says "break"."""

    name: ClassVar[str] = "broken"

    def __init__(self, config: Configured[Any, Any, Any], settings: Settings) -> None:
        self.settings = settings

    async def on_request(self, ex: Exchange) -> None:
        if ex.json["messages"][-1].get("content") == "break":
            raise RuntimeError("a bug")


def make(cls: type[P], settings: Settings, **options: Any) -> P:
    """A plugin as the runtime builds it: with its part of the config, as the loader validated it."""
    return cls(settings.plugin_config(cls.name), settings, **options)  # type: ignore[call-arg]


def runtime(store: Store | None = None) -> Runtime:
    """What a plugin's startup reads of the runtime: the store and the meter (with a registry of its own)."""
    return cast("Runtime", SimpleNamespace(store=store, meter=Meter(Metrics(TelemetrySettings()))))
