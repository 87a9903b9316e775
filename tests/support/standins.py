"""Stand-ins for the self-hosted servers the gateway speaks to: their health paths and semantics, cold loads.

Each is the scripted upstream (tests/support/upstream.py: a real HTTP/1.1 server on 127.0.0.1, OpenAI-format
answers on /v1/...) plus what the real server does beside them:

- `LlamaCppStandIn(load_s)`: llama-server. For `load_s` after start `GET /health` and every model route answer
  503 `{"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}`; then 200 `{"status":
  "ok"}` and normal answers.
- `TGIStandIn()`: text-generation-inference. `GET /health` 200, `GET /info` the model and its limits.
- `OllamaStandIn(load_ms, idle_s)`: Ollama. `GET /api/version`, `/api/tags`, `/api/ps` (the models in memory);
  a model not in memory is loaded by the request that names it, which waits `load_ms` more; a model idle for
  `idle_s` (or its `keep_alive`) is unloaded. `POST /api/generate` without a prompt only loads (keep_alive
  honoured: seconds, "Ns"/"Nm", -1 for ever, 0 unloads). Every model request is counted in `cold` when it
  paid the load.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, ClassVar

from tests.support.upstream import Behaviour, Recorded, ScriptedUpstream, Status

LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}


class LlamaCppStandIn(ScriptedUpstream):
    def __init__(self, load_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.load_s = load_s
        self.started = 0.0
        self.routes["/health"] = self.routes["/v1/health"] = self._health
        self.gate = self._gate

    def __enter__(self) -> LlamaCppStandIn:
        self.started = time.monotonic()
        super().__enter__()
        return self

    @property
    def loaded(self) -> bool:
        return time.monotonic() - self.started >= self.load_s

    async def _health(self, _: Recorded) -> tuple[int, Any]:
        return (200, {"status": "ok"}) if self.loaded else (503, LOADING)

    async def _gate(self, _: Recorded) -> Behaviour | None:
        return None if self.loaded else Status(503, LOADING)


class TGIStandIn(ScriptedUpstream):
    INFO: ClassVar[dict[str, Any]] = {
        "model_id": "stand-in/tgi-model",
        "max_input_tokens": 4095,
        "max_total_tokens": 4096,
        "version": "3.0.0",
    }

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.routes["/health"] = self._health
        self.routes["/info"] = self._info

    async def _health(self, _: Recorded) -> tuple[int, Any]:
        return 200, {}

    async def _info(self, _: Recorded) -> tuple[int, Any]:
        return 200, self.INFO


class OllamaStandIn(ScriptedUpstream):
    def __init__(self, load_ms: float = 1000.0, idle_s: float = 300.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.load_ms = load_ms
        self.idle_s = idle_s
        self.models = ["local:latest"]
        self.expires: dict[str, float] = {}  # model -> time.monotonic() when it unloads
        self.keep: dict[str, float] = {}  # model -> its keep_alive in seconds (the last request's)
        self.cold: list[Recorded] = []  # the model requests that paid the load
        self.loads = 0  # every load, by a model request or /api/generate
        self.pings: list[float] = []  # time.monotonic() of each POST /api/generate
        self._lock = threading.Lock()
        self.routes.update(
            {
                "/api/version": self._version,
                "/api/tags": self._tags,
                "/api/ps": self._ps,
                "/api/generate": self._generate,
            }
        )
        self.gate = self._gate

    def resident(self) -> list[str]:
        now = time.monotonic()
        with self._lock:
            return [model for model, until in self.expires.items() if until > now]

    async def _load(self, model: str, keep_alive: Any) -> bool:
        """Load `model` if it is not in memory; whether it had to be. Resets its idle timer either way."""
        seconds = _seconds(keep_alive) if keep_alive is not None else self.keep.get(model, self.idle_s)
        cold = model not in self.resident()
        if cold:
            await asyncio.sleep(self.load_ms / 1000.0)
        with self._lock:
            if cold:
                self.loads += 1
            self.keep[model] = seconds if keep_alive is not None else self.keep.get(model, self.idle_s)
            self.expires[model] = time.monotonic() + (float("inf") if seconds < 0 else seconds)
        return cold

    async def _gate(self, request: Recorded) -> Behaviour | None:
        model = str((request.json or {}).get("model") or "")
        # The /v1 routes have no keep_alive: the server's default applies again.
        with self._lock:
            self.keep[model] = self.idle_s
        if await self._load(model, None):
            self.cold.append(request)
        return None

    async def _version(self, _: Recorded) -> tuple[int, Any]:
        return 200, {"version": "0.5.7"}

    async def _tags(self, _: Recorded) -> tuple[int, Any]:
        return 200, {"models": [{"name": m, "model": m} for m in self.models]}

    async def _ps(self, _: Recorded) -> tuple[int, Any]:
        return 200, {"models": [{"name": m, "model": m} for m in self.resident()]}

    async def _generate(self, request: Recorded) -> tuple[int, Any]:
        self.pings.append(time.monotonic())
        body = request.json or {}
        model = str(body.get("model") or "")
        if body.get("keep_alive") == 0:
            with self._lock:
                self.expires.pop(model, None)
            return 200, {"model": model, "response": "", "done": True, "done_reason": "unload"}
        await self._load(model, body.get("keep_alive"))
        return 200, {"model": model, "response": "", "done": True, "done_reason": "load"}


def _seconds(value: Any) -> float:
    if isinstance(value, int | float):
        return float(value)
    text = str(value)
    for suffix, scale in (("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if text.endswith(suffix):
            return float(text.removesuffix(suffix)) * scale
    return float(text)
