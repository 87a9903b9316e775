"""The plugin contract: every built-in plugin's hooks have the signatures the pipeline calls them with.

Plugins are loaded by name, so nothing on the request path lets mypy see a plugin's class next to the type of
its hooks. The tuples below do: each names a plugin class under the protocol of a hook it defines, and mypy
checks the class against it. The test checks that the tuples name every hook every built-in plugin defines.
"""

from __future__ import annotations

from typing import Any

from gateway.plugin import (
    BUILTIN,
    HOOKS,
    HandlesComplete,
    HandlesFailure,
    HandlesRequest,
    HandlesResponse,
    ShutsDown,
    StartsUp,
    load_class,
)
from plugins.admission import Admission
from plugins.auth import Auth
from plugins.cache import Cache
from plugins.cascade import Cascade
from plugins.rate_limit import RateLimit
from plugins.semantic_cache import SemanticCache
from plugins.slo import Slo

STARTS_UP: tuple[type[StartsUp], ...] = (Auth, RateLimit, Cache, Slo, SemanticCache, Admission, Cascade)
HANDLES_REQUEST: tuple[type[HandlesRequest], ...] = (Auth, RateLimit, Cache, Slo, SemanticCache, Admission, Cascade)
HANDLES_FAILURE: tuple[type[HandlesFailure], ...] = (Cache,)
HANDLES_RESPONSE: tuple[type[HandlesResponse], ...] = (Cache, SemanticCache, Admission)
HANDLES_COMPLETE: tuple[type[HandlesComplete], ...] = (RateLimit, Cache, Slo, SemanticCache, Admission)
SHUTS_DOWN: tuple[type[ShutsDown], ...] = (Auth, RateLimit, Cache, SemanticCache, Admission)

CHECKED: dict[str, tuple[type[Any], ...]] = {
    "startup": STARTS_UP,
    "on_request": HANDLES_REQUEST,
    "on_failure": HANDLES_FAILURE,
    "on_response": HANDLES_RESPONSE,
    "on_complete": HANDLES_COMPLETE,
    "shutdown": SHUTS_DOWN,
}


def test_every_hook_of_every_builtin_plugin_is_checked() -> None:
    assert set(CHECKED) == set(HOOKS)
    for spec in BUILTIN:
        cls = load_class(spec)
        defined = {hook for hook in HOOKS if callable(getattr(cls, hook, None))}
        checked = {hook for hook, classes in CHECKED.items() if cls in classes}
        assert defined == checked, f"{spec}: hooks defined {sorted(defined)}, checked {sorted(checked)}"
