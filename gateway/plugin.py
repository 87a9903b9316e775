"""The plugin contract: optional stages named in the config's `plugins:` list, run in that order.

Every hook is optional and named after the moment it fires. The pipeline builds one list per hook at
start-up, holding only the plugins that define it, so an unused hook costs nothing per request. A plugin
whose config leaves one of its hooks nothing to do names it in an instance attribute `idle` (a set of hook
names, read once at start-up): the admission plugin's `on_response` serves only service tiers.

- `startup(runtime)`: once, before the gateway reports ready. Open connections, load keys.
- `on_request(ex)`: the request is parsed, nothing has gone upstream. Return a `Reply` to answer now
  (a cache hit), raise `GatewayError` to reject (401, 429), or return None to go on. May reorder
  `ex.targets` (the SLO plugin does). A plugin whose on_request waits only now and then may define it as a
  plain method that returns its answer, or an awaitable of it when it must wait: no coroutine is made for the
  common case (the admission plugin's, which waits only for a saturated backend).
- `on_failure(ex, error)`: every target failed with `error` (a GatewayError). Return a `Reply` to answer
  anyway (a stale cache entry), or None to let the error go out.
- `on_response(ex, head)`: status and headers are known, nothing is sent yet. May add headers (headers known
  before the answer are cheaper added from on_request with `ex.add_response_headers`: no hook runs). May return
  a `Tap`: a cheap synchronous callable given every body chunk as it passes (and b"" at the end); return
  one only when the bytes are needed, since it is the one per-chunk cost a plugin can add.
- `on_complete(ex, outcome)`: after the last byte went to the client (or the request failed). Runs off the
  response path; exceptions are logged with the plugin's name and never reach the client. A plugin whose
  completion never waits may define it as a plain method: no coroutine is made for it (the admission
  plugin's, which frees a slot).
- `shutdown()`: once, when the gateway stops.

Plugins never call each other; they share data through `ex.state`.

**Config** (the Envoy model: typed per-filter config). A plugin declares its `schema`: the pydantic model of
its top-level section (under its own name), of the keys it owns under `models.NAME` and `tenants.NAME`, and
the plugins that must run before it. The loader (gateway/config.py) hands each part of the YAML to its
plugin's model and constructs the plugin with the result, a `Configured`; a part whose plugin is not
listed is a config error, never a feature silently off. An optional `check(config, settings, listed)`
classmethod returns further problems as (YAML path, message) pairs: cross-references the core cannot know.
An optional `advise(config, settings, listed)` classmethod returns warnings the same way: a config that is
valid but most likely not what was meant (auth with no key anywhere refuses every request), said by both
`sluice check` and `sluice serve`.
An optional `purge(config, settings, tenant, model)` classmethod removes a tenant's entries (of one model, or
all when model is None) from what the plugin keeps outside any one process, for `sluice cache purge`; it
returns (entries removed, a note for the operator or "").

**Reports.** What telemetry needs from a plugin it says through the Exchange, never through its private
state: `ex.labels[label] = value` for the metric labels it declares in `schema.labels` (also span
attributes `sluice.<label>`), `ex.attributes[...]` for extra span attributes. Its own series it makes at
`startup` through `runtime.meter`. A request a plugin rejects is marked with `ex.rejected_by`.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, Protocol, TypeAlias, TypeVar, overload

from pydantic import BaseModel

# Named here for plugins, which take the whole contract from this module.
from gateway.response import Outcome as Outcome
from gateway.response import Reply as Reply
from gateway.response import ResponseHead as ResponseHead
from gateway.response import Tap as Tap
from gateway.settings import Strict

if TYPE_CHECKING:
    from gateway.context import Exchange
    from gateway.errors import GatewayError
    from gateway.runtime import Runtime
    from gateway.settings import Settings

BUILTIN = {
    "auth": "plugins.auth:Auth",
    "rate_limit": "plugins.rate_limit:RateLimit",
    "cache": "plugins.cache:Cache",
    "slo": "plugins.slo:Slo",
    "semantic_cache": "plugins.semantic_cache:SemanticCache",
    "admission": "plugins.admission:Admission",
    "cascade": "plugins.cascade:Cascade",
}
# Commands that come with a built-in plugin (`sluice keys` manages the auth plugin's key store): a module with
# add_arguments(parser) and main(args) -> exit code, imported only when its command runs.
BUILTIN_COMMANDS = {
    "keys": ("plugins.auth.keys", "make gateway keys; add, revoke and list them in Redis"),
    "cache": (
        "plugins.cache.commands",
        "prefill the cache from a file of requests; its stats; purge a tenant; evaluate (see `sluice semantic`)",
    ),
    "semantic": ("plugins.semantic_cache.command", "measure the semantic cache's false hits on labelled pairs"),
}
# An action offered under another command, where users look for it: (command, action) -> the command that owns
# it. `sluice cache evaluate` measures the semantic cache: the semantic_cache plugin owns it (`sluice semantic
# evaluate`), and the cache plugin neither knows of it nor imports it.
COMMAND_ALIASES = {("cache", "evaluate"): "semantic"}

Problem = tuple[str, str]  # (YAML path, what is wrong there)


class Empty(Strict):
    """A part of the config a plugin does not use: no keys."""


SectionT = TypeVar("SectionT", bound=BaseModel)
ModelT = TypeVar("ModelT", bound=BaseModel)
TenantT = TypeVar("TenantT", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class Schema:
    """What a plugin reads from the config, what it needs of the other plugins, what it reports."""

    section: type[BaseModel] = Empty  # its top-level section, under the plugin's name
    model: type[BaseModel] = Empty  # the keys it owns under models.NAME
    tenant: type[BaseModel] = Empty  # the keys it owns under tenants.NAME
    after: tuple[str, ...] = ()  # plugins that, when listed, must run before it
    labels: Mapping[str, str] = field(default_factory=dict)  # metric labels it sets per request -> default


@dataclass(frozen=True, slots=True)
class Configured(Generic[SectionT, ModelT, TenantT]):
    """A plugin's parts of the config, validated: defaults wherever the YAML says nothing."""

    section: SectionT
    models: Mapping[str, ModelT]  # every model of the config
    tenants: Mapping[str, TenantT]  # every tenant of the config


class Plugin(Protocol):
    name: ClassVar[str]
    schema: ClassVar[Schema]

    def __init__(self, config: Configured[Any, Any, Any], settings: Settings) -> None: ...


def schema_of(cls: type[Any]) -> Schema:
    """A plugin class's schema; a plugin that reads no config need not declare one."""
    schema = getattr(cls, "schema", None)
    return schema if isinstance(schema, Schema) else Schema()


def checks_of(cls: type[Any]) -> Callable[[Configured[Any, Any, Any], Settings, Sequence[str]], Iterable[Problem]]:
    check = getattr(cls, "check", None)
    return check if callable(check) else _no_problems


def advice_of(cls: type[Any]) -> Callable[[Configured[Any, Any, Any], Settings, Sequence[str]], Iterable[Problem]]:
    advise = getattr(cls, "advise", None)
    return advise if callable(advise) else _no_problems


def _no_problems(_config: Configured[Any, Any, Any], _settings: Settings, _listed: Sequence[str]) -> Iterable[Problem]:
    return ()


def load_class(spec: str) -> type[Plugin]:
    """A plugin class from a built-in name or "package.module:Class"."""
    path = BUILTIN.get(spec, spec)
    module_name, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"plugin {spec!r}: expected a built-in name or 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"plugin {spec!r}: cannot import {module_name}: {exc}") from exc
    cls = getattr(module, attr, None)
    if cls is None:
        raise ValueError(f"plugin {spec!r}: {module_name} has no {attr}")
    if not isinstance(getattr(cls, "name", None), str):
        raise ValueError(f"plugin {spec!r}: {attr} has no `name`")
    return cls  # type: ignore[no-any-return]


# Each hook's signature, as the pipeline and the runtime call it (see the module's docstring for when).
Startup: TypeAlias = "Callable[[Runtime], Awaitable[None]]"
OnRequest: TypeAlias = "Callable[[Exchange], Awaitable[Reply | None] | Reply | None]"
OnFailure: TypeAlias = "Callable[[Exchange, GatewayError], Awaitable[Reply | None]]"
OnResponse: TypeAlias = "Callable[[Exchange, ResponseHead], Awaitable[Tap | None]]"
OnComplete: TypeAlias = "Callable[[Exchange, Outcome], Awaitable[None] | None]"
Shutdown: TypeAlias = "Callable[[], Awaitable[None]]"
HookT = TypeVar("HookT")
Hooks: TypeAlias = tuple[tuple[str, HookT], ...]  # (plugin name, bound hook), in the config's order


# The same signatures as protocols a plugin class satisfies, one a hook: what mypy checks a plugin's hooks
# against (tests/unit/test_plugin_contract.py names every built-in plugin under each hook it defines).
class StartsUp(Protocol):
    async def startup(self, runtime: Runtime) -> None: ...


class HandlesRequest(Protocol):
    def on_request(self, ex: Exchange) -> Awaitable[Reply | None] | Reply | None: ...


class HandlesFailure(Protocol):
    async def on_failure(self, ex: Exchange, error: GatewayError) -> Reply | None: ...


class HandlesResponse(Protocol):
    async def on_response(self, ex: Exchange, head: ResponseHead) -> Tap | None: ...


class HandlesComplete(Protocol):
    def on_complete(self, ex: Exchange, outcome: Outcome) -> Awaitable[None] | None: ...


class ShutsDown(Protocol):
    async def shutdown(self) -> None: ...


HOOKS: Mapping[str, type[Any]] = {
    "startup": StartsUp,
    "on_request": HandlesRequest,
    "on_failure": HandlesFailure,
    "on_response": HandlesResponse,
    "on_complete": HandlesComplete,
    "shutdown": ShutsDown,
}


@overload
def hooks(plugins: Sequence[Plugin], name: Literal["startup"]) -> Hooks[Startup]: ...
@overload
def hooks(plugins: Sequence[Plugin], name: Literal["on_request"]) -> Hooks[OnRequest]: ...
@overload
def hooks(plugins: Sequence[Plugin], name: Literal["on_failure"]) -> Hooks[OnFailure]: ...
@overload
def hooks(plugins: Sequence[Plugin], name: Literal["on_response"]) -> Hooks[OnResponse]: ...
@overload
def hooks(plugins: Sequence[Plugin], name: Literal["on_complete"]) -> Hooks[OnComplete]: ...
@overload
def hooks(plugins: Sequence[Plugin], name: Literal["shutdown"]) -> Hooks[Shutdown]: ...
def hooks(plugins: Sequence[Plugin], name: str) -> Hooks[Callable[..., Awaitable[Any]]]:
    """(plugin name, bound hook) for every plugin that defines hook `name` and has not named it `idle`, in order.

    Plugins are loaded by name, so a hook's type is asserted here, once, from its name: the one place the
    signature is taken on trust (the plugins' own classes are checked against the protocols above).
    """
    return tuple(
        (p.name, getattr(p, name))
        for p in plugins
        if callable(getattr(p, name, None)) and name not in getattr(p, "idle", ())
    )
