"""A stand-in for Ollama: its native API, its OpenAI compatibility, and models that load and unload.

Paths (github.com/ollama/ollama docs/api.md and docs/openai.md, docs.ollama.com): `GET /` ("Ollama is
running"), `GET /api/version`, `GET /api/tags` (models available), `GET /api/ps` (models loaded, with
`expires_at`), `POST /api/chat` and `POST /api/generate` (NDJSON streams, `stream` true unless false),
`POST /v1/chat/completions`, `GET /v1/models`.

Loading, as Ollama does it:

- The server answers at once; a model loads on the first request that needs it (`load_ms`, paid by that
  request and by any that arrive while it loads) and stays loaded for its keep-alive after the last request
  ends, then unloads, so the next request pays `load_ms` again.
- `keep_alive` is read by `/api/chat` and `/api/generate` only: a number of seconds or a Go duration
  ("10m", "1h30m", "0"); negative keeps the model loaded for good, 0 unloads it as soon as the request ends.
  Without it the server default applies (`--idle-unload-s`, Ollama's 5 minutes). `/v1/chat/completions`
  does not take `keep_alive` (it is not among the supported request fields of the OpenAI compatibility
  docs), so there it is ignored like any other unsupported field (`n`, `logit_bias`, ...).
- `/api/chat` with no messages, or `/api/generate` with an empty prompt, only loads the model (answer
  `done_reason: "load"`, counted as a warm-up); with `keep_alive: 0` it unloads it (`done_reason: "unload"`).

Also as Ollama does (`server/routes.go`, `openai/openai.go`, `api/types.go`): a model name without a tag
means `:latest`; an unknown model is a 404 "model 'x' not found", `{"error": "..."}` natively and
`{"error": {"message", "type": "not_found_error"}}` on `/v1`; `stream_options.include_usage` is honoured on
`/v1`, where usage is the native counts (`prompt_eval_count` includes a cached prefix) with no cached-token
details.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import orjson

from gateway.simulation.answers import simulate
from tools.sim.engine import Engine, Options, Replica, openai, prompt_tokens, stats_response
from tools.sim.httpd import Request, Response, json_response

VERSION = "0.33.0"
NDJSON = "application/x-ndjson"
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_GO_TYPES = {bool: "bool", list: "[]interface {}"}  # what Go's JSON decoding calls them
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_FOREVER_S = 10**10  # how /api/ps shows a model kept loaded for good: an expiry centuries away
_SIZE = 2_019_393_189
_DIGEST = "a80c4f17acd55265feec403c7aef86be0c25983ab279d83f3bcd3abbcb5b8b72"
_DETAILS = {
    "parent_model": "",
    "format": "gguf",
    "family": "llama",
    "families": ["llama"],
    "parameter_size": "3.2B",
    "quantization_level": "Q4_K_M",
}


def keep_alive(value: Any, default_s: float) -> float:
    """Seconds to stay loaded after a request (negative: for good); ValueError for what Ollama refuses."""
    if value is None:
        return default_s
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, str):
        kind = _GO_TYPES.get(type(value), "map[string]interface {}")
        raise ValueError(f"Unsupported type: '{kind}'")
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    text = text.lstrip("+-")
    if text == "0":
        return 0.0
    if re.fullmatch(r"\d+(\.\d*)?", text):
        raise ValueError(f'time: missing unit in duration "{value}"')
    parts = _DURATION.findall(text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        raise ValueError(f'time: invalid duration "{value}"')
    return sign * sum(float(number) * _UNITS[unit] for number, unit in parts)


class Model:
    """One model's load state: loaded or not, requests using it, and when it unloads."""

    def __init__(self, name: str, options: Options, engine: Engine) -> None:
        self.name = name
        self.options = options
        self.stats = engine.stats
        self.loaded = False
        self.loading: asyncio.Future[None] | None = None
        self.active = 0
        self.expires_at = 0.0  # wall-clock seconds
        self.timer: asyncio.TimerHandle | None = None

    async def acquire(self) -> float:
        """Hold the model loaded for one request; the seconds this request spent waiting for a load."""
        self.active += 1
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.loaded:
            return 0.0
        start = time.monotonic()
        try:
            if self.loading is None:
                self.loading = asyncio.ensure_future(self._load())
            await asyncio.shield(self.loading)
        except BaseException:
            self.release(self.options.idle_unload_s)
            raise
        return time.monotonic() - start

    async def _load(self) -> None:
        await asyncio.sleep(self.options.load_ms / 1000.0)
        self.loaded = True
        self.loading = None
        self.stats.loads += 1

    def release(self, keep_s: float) -> None:
        """One request is done with the model: it stays loaded `keep_s` more seconds once none use it."""
        self.active -= 1
        if self.active > 0 or not self.loaded:
            return
        if keep_s < 0:
            self.expires_at = time.time() + _FOREVER_S
        elif keep_s == 0:
            self._unload()
        else:
            self.expires_at = time.time() + keep_s
            self.timer = asyncio.get_running_loop().call_later(keep_s, self._unload)

    def unload(self) -> None:
        """Unload now if no request is using the model (`keep_alive: 0` with nothing to generate)."""
        if self.timer is not None:
            self.timer.cancel()
        self._unload()

    def _unload(self) -> None:
        self.timer = None
        if self.loaded and self.active == 0:
            self.loaded = False
            self.stats.unloads += 1

    def listing(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.name,
            "size": _SIZE,
            "digest": _DIGEST,
            "details": _DETAILS,
        }


def build(options: Options, replica: int) -> Replica:
    engine = Engine(options, replica)
    model = Model(_full_name(options.model), options, engine)
    created = int(time.time())

    async def handle(request: Request) -> Response:
        path = request.path
        if path == "/":
            return Response(200, b"Ollama is running", "text/plain; charset=utf-8")
        if path == "/api/version":
            return json_response(200, {"version": VERSION})
        if path == "/api/tags":
            modified = _iso(created)
            return json_response(200, {"models": [{**model.listing(), "modified_at": modified}]})
        if path == "/api/ps":
            return json_response(200, {"models": [_running(model)] if model.loaded else []})
        if path == "/v1/models":
            entry = {"id": model.name, "object": "model", "created": created, "owned_by": "library"}
            return json_response(200, {"object": "list", "data": [entry]})
        if path == "/_sim/stats":
            return stats_response(engine)
        if path not in ("/api/chat", "/api/generate", "/v1/chat/completions"):
            return Response(404, b"404 page not found", "text/plain")
        if request.method != "POST":
            return Response(405, b"405 method not allowed", "text/plain")
        try:
            body = request.json()
        except ValueError as exc:
            return _error(path, 400, str(exc))
        if not isinstance(body, dict):
            return _error(path, 400, "the request body must be a JSON object")
        name = body.get("model")
        if not isinstance(name, str) or not name:
            return _error(path, 400, "model is required")
        if _full_name(name) != model.name:
            return _error(path, 404, f"model '{name}' not found")
        if path == "/v1/chat/completions":
            return await _openai(engine, model, body, name)
        try:
            keep_s = keep_alive(body.get("keep_alive"), options.idle_unload_s)
        except ValueError as exc:
            return _error(path, 400, str(exc))
        return await _native(engine, model, path, body, name, keep_s)

    return Replica(handle, engine)


async def _openai(engine: Engine, model: Model, body: dict[str, Any], name: str) -> Response:
    """The OpenAI-compatible path: loads the model like any request, with the server's default keep-alive."""
    body = {key: value for key, value in body.items() if key not in ("n", "keep_alive")}
    keep_s = engine.options.idle_unload_s
    if body.get("stream") is True:
        response = await openai(engine, "chat/completions", body, name, report_cached=False)
        if not isinstance(response.body, bytes):
            response.body = _held(response.body, model, keep_s)
        return response
    await model.acquire()
    try:
        return await openai(engine, "chat/completions", body, name, report_cached=False)
    finally:
        model.release(keep_s)


async def _held(body: AsyncIterator[bytes], model: Model, keep_s: float) -> AsyncIterator[bytes]:
    """`body` once the model is loaded, keeping it loaded until the stream ends or its client leaves.

    The model is taken when the stream starts, not before, so a stream that never starts holds nothing.
    """
    await model.acquire()
    try:
        async for piece in body:
            yield piece
    finally:
        aclose = getattr(body, "aclose", None)
        if aclose is not None:
            await aclose()  # frees the batch slot now, not when the collector gets to it
        model.release(keep_s)


async def _native(engine: Engine, model: Model, path: str, body: dict[str, Any], name: str, keep_s: float) -> Response:
    chat = path == "/api/chat"
    messages = body.get("messages") if chat else None
    prompt = None if chat else body.get("prompt")
    if (chat and not messages) or (not chat and not prompt):
        return await _warm(engine, model, chat, name, keep_s)
    if not chat:
        if not isinstance(prompt, str):
            return _error(path, 400, "prompt must be a string")
        messages = [{"role": "user", "content": prompt}]
    limit = (body.get("options") or {}).get("num_predict") if isinstance(body.get("options"), dict) else None
    ask: dict[str, Any] = {"messages": messages}
    if type(limit) is int and limit > 0:
        ask["max_tokens"] = limit
    probe = simulate("chat/completions", ask, name, engine.options.profile)
    if probe.status != 200:
        return _error(path, probe.status, orjson.loads(probe.pieces[0])["error"]["message"])
    answer = orjson.loads(probe.pieces[0])
    words = answer["choices"][0]["message"]["content"].split(" ")
    pieces = [words[0]] + [" " + word for word in words[1:]]
    finish = answer["choices"][0]["finish_reason"]
    stream = body.get("stream", True) is not False
    lines = _lines(engine, model, chat, name, ask, pieces, finish, keep_s)
    if stream:
        return Response(200, lines, NDJSON)
    text = "".join(pieces)
    async for line in lines:
        final = orjson.loads(line)
    final["message" if chat else "response"] = {"role": "assistant", "content": text} if chat else text
    return Response(200, orjson.dumps(final), "application/json; charset=utf-8")


async def _lines(
    engine: Engine,
    model: Model,
    chat: bool,
    name: str,
    ask: dict[str, Any],
    pieces: list[str],
    finish: str,
    keep_s: float,
) -> AsyncIterator[bytes]:
    """The NDJSON stream of a native answer, paced by the replica; the last line carries the timings.

    It takes the model (loading it if need be) when it starts, so a stream that never starts holds nothing.
    """
    tokens = prompt_tokens("chat/completions", ask)
    started = time.monotonic()
    load_s = await model.acquire()
    try:
        async with engine.generation(tokens, len(pieces)) as generation:
            prefill_start = time.monotonic()
            await generation.prefill()
            eval_start = time.monotonic()
            for i, piece in enumerate(pieces):
                if i:
                    await generation.decode()
                yield _line(chat, name, piece, False)
            end = time.monotonic()
        final = {
            **_head(chat, name, ""),
            "done_reason": finish,
            "done": True,
            "total_duration": _ns(end - started),
            "load_duration": _ns(load_s),
            "prompt_eval_count": len(tokens),
            "prompt_eval_duration": _ns(eval_start - prefill_start),
            "eval_count": len(pieces),
            "eval_duration": _ns(end - eval_start),
        }
        yield orjson.dumps(final) + b"\n"
    finally:
        model.release(keep_s)


async def _warm(engine: Engine, model: Model, chat: bool, name: str, keep_s: float) -> Response:
    """A request with nothing to generate: load (or, with keep_alive 0, unload) the model."""
    engine.stats.warmups += 1
    if keep_s == 0:
        model.unload()
        reason = "unload"
    else:
        await model.acquire()
        model.release(keep_s)
        reason = "load"
    return json_response(200, {**_head(chat, name, ""), "done_reason": reason, "done": True})


def _line(chat: bool, name: str, piece: str, done: bool) -> bytes:
    return orjson.dumps({**_head(chat, name, piece), "done": done}) + b"\n"


def _head(chat: bool, name: str, text: str) -> dict[str, Any]:
    head: dict[str, Any] = {"model": name, "created_at": _iso(time.time())}
    if chat:
        head["message"] = {"role": "assistant", "content": text}
    else:
        head["response"] = text
    return head


def _running(model: Model) -> dict[str, Any]:
    expires = _iso(model.expires_at)
    return {**model.listing(), "expires_at": expires, "size_vram": _SIZE, "context_length": model.options.max_model_len}


def _error(path: str, status: int, message: str) -> Response:
    if path.startswith("/v1/"):
        kind = {400: "invalid_request_error", 404: "not_found_error"}.get(status, "api_error")
        return json_response(status, {"error": {"message": message, "type": kind, "param": None, "code": None}})
    return json_response(status, {"error": message})


def _full_name(name: str) -> str:
    return name if ":" in name else name + ":latest"


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(min(seconds, 253_402_300_799), UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
