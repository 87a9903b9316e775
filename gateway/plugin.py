"""The plugin contract: optional stages named in the config's `plugins:` list, run in that order.

Every hook is optional and named after the moment it fires. The pipeline builds one list per hook at
start-up, holding only the plugins that define it, so an unused hook costs nothing per request.

- `startup(runtime)`: once, before the gateway reports ready. Open connections, load keys.
- `on_request(ex)`: the request is parsed, nothing has gone upstream. Return a `Reply` to answer now
  (a cache hit), raise `GatewayError` to reject (401, 429), or return None to go on. May reorder
  `ex.targets` (the SLO plugin does).
- `on_failure(ex, error)`: every target failed with `error` (a GatewayError). Return a `Reply` to answer
  anyway (a stale cache entry), or None to let the error go out.
- `on_response(ex, head)`: status and headers are known, nothing is sent yet. May add headers. May return
  a `Tap`: a cheap synchronous callable given every body chunk as it passes (and b"" at the end); return
  one only when the bytes are needed, since it is the one per-chunk cost a plugin can add.
- `on_complete(ex, outcome)`: after the last byte went to the client (or the request failed). Runs off the
  response path; exceptions are logged with the plugin's name and never reach the client.
- `shutdown()`: once, when the gateway stops.

Plugins never call each other; they share data through `ex.state`.
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from gateway.settings import Settings

BUILTIN = {
    "auth": "plugins.auth:Auth",
    "rate_limit": "plugins.rate_limit:RateLimit",
    "cache": "plugins.cache:Cache",
    "slo": "plugins.slo:Slo",
}

Tap = Callable[[bytes], None]


@dataclass(slots=True)
class Reply:
    """An answer made by a plugin instead of an upstream: a whole body, or a stream of body pieces."""

    status: int = 200
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    source: str = ""  # the plugin that answered


@dataclass(slots=True)
class ResponseHead:
    status: int
    headers: list[tuple[bytes, bytes]]  # what the client will get; plugins may append


@dataclass(slots=True)
class Outcome:
    """What happened, known once the response has ended."""

    status: int
    complete: bool = False  # the whole body reached the client (for streams: up to [DONE])
    error: str | None = None  # why it did not, when it did not
    client_gone: bool = False
    ttft_ms: float | None = None  # streams: to the first chunk carrying content
    tpot_ms: float | None = None  # streams: mean time per output token after the first
    total_ms: float = 0.0
    chunks: int = 0
    usage: dict[str, Any] | None = None
    usage_source: str = "upstream"  # "estimated": counted from a stream's events, the upstream sent none
    source: str = "upstream"  # "upstream" or the plugin that answered


class Plugin(Protocol):
    name: ClassVar[str]

    def __init__(self, settings: Settings) -> None: ...


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
    return cls  # type: ignore[no-any-return]


def hooks(plugins: list[Plugin], name: str) -> tuple[tuple[str, Callable[..., Any]], ...]:
    """(plugin name, bound hook) for every plugin that defines hook `name`, in order."""
    return tuple((p.name, getattr(p, name)) for p in plugins if callable(getattr(p, name, None)))
