"""A stand-in for llama.cpp's `llama-server`, on the replica model (its slots are the batch).

Paths (github.com/ggml-org/llama.cpp, tools/server/README.md): `GET /health` and `/v1/health`,
`GET /v1/models`, `/models` and `/api/tags`, `GET /props`, `GET /slots`, `GET /metrics` (with `--metrics`),
`POST /v1/chat/completions` and `/chat/completions`, `POST /v1/completions` and `/completions`.

Behaviour a gateway meets, as a real server (build b11434) shows it:

- Start-up: the port opens at once and, until the model is loaded (`load_ms`), every path but the model
  lists (`/models`, `/v1/models`, `/api/tags`, which the server's `middleware_server_state` lets through)
  answers 503 `{"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}`; then
  `/health` is 200 `{"status": "ok"}`, and stays so while busy.
- `n` (an alias of `n_cmpl`) may be 1 up to the slot count (`max_batch`, the server's `-np`); outside it,
  400 "Field 'n': Value must be between 1 <= value <= N, but got X". The choices take a slot each (a
  request waits until it has them all) and share the prompt's prefill. A whole answer's usage counts the
  first choice only; a stream interleaves the choices' tokens and sends each choice's finish chunk and,
  with `include_usage`, its own usage-only chunk. Errors are `{"error": {"code", "message", "type"}}`.
- `model` is not checked: the server has one model and names it (its `--alias`) in every answer.
- Streams carry no `"usage":null`; `stream_options.include_usage` adds a chunk with empty `choices`, the
  usage (with `prompt_tokens_details.cached_tokens`, the prompt-cache reuse) and `timings`; without it, the
  finish chunk carries `timings`. Whole answers carry `timings` too (`cache_n`, `prompt_n`, `predicted_n`).
- Metrics with llama.cpp's names: `llamacpp:prompt_tokens_total` (prompt tokens computed, the cached ones
  excluded), `llamacpp:prompt_tokens_cached_total`, `llamacpp:tokens_predicted_total`,
  `llamacpp:requests_processing`, `llamacpp:requests_deferred`, ...
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.simulation.answers import simulate
from gateway.wire.completion import sse
from tools.sim.engine import Engine, Generation, Options, Replica, answer_tokens, prompt_tokens, stats_response
from tools.sim.httpd import Request, Response, json_response

BUILD = "b11434"
_ENDPOINTS = {
    "/v1/chat/completions": "chat/completions",
    "/chat/completions": "chat/completions",
    "/v1/completions": "completions",
    "/completions": "completions",
}
_LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
_NULL_USAGE = b',"usage":null'


@dataclass(slots=True)
class Clock:
    """What llama.cpp's /metrics counts beyond the engine's tokens: time spent, decode calls, longest sequence."""

    prompt_s: float = 0.0
    predict_s: float = 0.0
    decodes: int = 0
    busy: int = 0  # slots busy, summed over decode calls
    tokens_max: int = 0


def build(options: Options, replica: int) -> Replica:
    engine = Engine(options, replica)
    clock = Clock()
    created = int(time.time())
    ready_at = time.monotonic() + options.load_ms / 1000.0
    loaded = False

    async def handle(request: Request) -> Response:
        nonlocal loaded
        path = request.path
        if path == "/_sim/stats":
            return stats_response(engine)
        if path in ("/v1/models", "/models", "/api/tags"):
            return json_response(200, _models(options, created))
        if not loaded:
            if time.monotonic() < ready_at:
                return json_response(503, _LOADING)
            loaded = True
            engine.stats.loads += 1
        if path in ("/health", "/v1/health"):
            return json_response(200, {"status": "ok"})
        if path == "/props":
            return json_response(200, _props(options))
        if path == "/slots":
            return json_response(200, _slots(engine))
        if path == "/metrics":
            return Response(200, _metrics(engine, clock).encode(), "text/plain; version=0.0.4")
        endpoint = _ENDPOINTS.get(path)
        if endpoint is None:
            return error(404, "File Not Found", "not_found_error")
        if request.method != "POST":
            return error(405, "Method Not Allowed", "invalid_request_error")
        try:
            body = request.json()
        except ValueError as exc:
            return error(400, f"[json.exception.parse_error] {exc}")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        choices = _choices(body, options.max_batch)
        if isinstance(choices, Response):
            return choices
        return await _answer(engine, clock, endpoint, body, choices)

    return Replica(handle, engine)


def error(status: int, message: str, kind: str = "invalid_request_error") -> Response:
    return json_response(status, {"error": {"code": status, "message": message, "type": kind}})


def _choices(body: dict[str, Any], slots: int) -> int | Response:
    """`n_cmpl`, else its alias `n` (null is absent), within 1 and the slot count, as the server's schema checks it."""
    for name in ("n_cmpl", "n"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            kind = "boolean" if isinstance(value, bool) else type(value).__name__
            return error(400, f"Field '{name}': [json.exception.type_error.302] type must be number, but is {kind}")
        count = int(value)
        if not 1 <= count <= slots:
            return error(400, f"Field '{name}': Value must be between 1 <= value <= {slots}, but got {count}")
        return count
    return 1


async def _answer(engine: Engine, clock: Clock, endpoint: str, body: dict[str, Any], choices: int) -> Response:
    """The answer, paced by the replica: `choices` slots, one prefill, the choices decoded side by side."""
    options = engine.options
    model = options.model
    probe = simulate(endpoint, body, model, options.profile)
    if probe.status != 200:
        return error(probe.status, orjson.loads(probe.pieces[0])["error"]["message"])
    if probe.tokens <= 1:
        engine.stats.warmups += 1  # what a warm-up looks like: max_tokens 1
    tokens = prompt_tokens(endpoint, body)
    generation = engine.generation(tokens, probe.tokens)
    clock.tokens_max = max(clock.tokens_max, len(tokens) + probe.tokens)
    if not probe.stream:
        async with generation, _more_slots(engine, choices - 1):
            reply = simulate(endpoint, body, model, options.profile, generation.cached)
            timings = await _generate(generation, clock, reply.tokens, choices)
            generation.generated(answer_tokens(endpoint, reply.text))
        return Response(200, _whole(reply.pieces[0], choices, timings))

    async def events() -> AsyncIterator[bytes]:
        async with generation, _more_slots(engine, choices - 1):
            reply = simulate(endpoint, body, model, options.profile, generation.cached)
            pieces = [piece.replace(_NULL_USAGE, b"") for piece in reply.pieces]  # llama.cpp sends none
            lead = 1 if endpoint == "chat/completions" else 0  # a chat stream opens with its role event
            last = lead + reply.tokens
            started = time.perf_counter()
            await generation.prefill()
            engine.generation_tokens += choices - 1  # each choice's first token
            prompt_ms = (time.perf_counter() - started) * 1000.0
            yield b"".join(_each(piece, choices) for piece in pieces[: lead + 1])
            for piece in pieces[lead + 1 : last]:
                await _decode(generation, clock, choices)
                yield _each(piece, choices)
            generation.generated(answer_tokens(endpoint, reply.text))
            timings = _timings(generation, reply.tokens, prompt_ms, (time.perf_counter() - started) * 1000.0)
            clock.prompt_s += prompt_ms / 1000.0
            clock.predict_s += timings["predicted_ms"] / 1000.0
            end, done = pieces[last:-1], pieces[-1]
            # Each choice ends with its finish chunk and, asked for, its usage chunk; the last carries `timings`.
            ends = [*end[:-1], _with(end[-1], timings)]
            yield b"".join(_each(piece, choices, index) for index in range(choices) for piece in ends) + done

    return Response(200, events(), "text/event-stream")


@contextlib.asynccontextmanager
async def _more_slots(engine: Engine, count: int) -> AsyncIterator[None]:
    """Hold `count` more slots (the other choices') for as long as the request runs."""
    held = 0
    try:
        for _ in range(count):
            await engine.admit()
            held += 1
        yield
    finally:
        for _ in range(held):
            engine.release()


async def _generate(generation: Generation, clock: Clock, count: int, choices: int) -> dict[str, Any]:
    started = time.perf_counter()
    await generation.prefill()
    generation.engine.generation_tokens += choices - 1  # each choice's first token
    prompt_ms = (time.perf_counter() - started) * 1000.0
    for _ in range(count - 1):
        await _decode(generation, clock, choices)
    total_ms = (time.perf_counter() - started) * 1000.0
    timings = _timings(generation, count, prompt_ms, total_ms)
    clock.prompt_s += prompt_ms / 1000.0
    clock.predict_s += timings["predicted_ms"] / 1000.0
    return timings


async def _decode(generation: Generation, clock: Clock, choices: int) -> None:
    await generation.decode()
    generation.engine.generation_tokens += choices - 1  # one decode call advances every choice
    clock.decodes += 1
    clock.busy += generation.engine.running


def _timings(generation: Generation, count: int, prompt_ms: float, total_ms: float) -> dict[str, Any]:
    """llama.cpp's `timings` of one choice: the prompt's tokens computed and reused, the tokens predicted."""
    computed = len(generation.tokens) - generation.cached
    predicted_ms = max(0.0, total_ms - prompt_ms)
    return {
        "cache_n": generation.cached,
        "prompt_n": computed,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / max(1, computed),
        "prompt_per_second": computed * 1000.0 / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": count,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / max(1, count),
        "predicted_per_second": count * 1000.0 / predicted_ms if predicted_ms > 0 else 0.0,
    }


def _each(piece: bytes, choices: int, index: int | None = None) -> bytes:
    """The event as choice `index` sends it, or as every choice does in turn (the choices interleave)."""
    if index is not None:
        return piece.replace(b'"index":0', b'"index":%d' % index, 1) if index else piece
    if choices == 1:
        return piece
    return b"".join(_each(piece, choices, i) for i in range(choices))


def _with(event: bytes, timings: dict[str, Any]) -> bytes:
    """An SSE event with llama.cpp's `timings` added."""
    payload = orjson.loads(event.removeprefix(b"data: ").rstrip())
    return sse(orjson.dumps({**payload, "timings": timings}))


def _whole(body: bytes, choices: int, timings: dict[str, Any]) -> bytes:
    """A whole answer of `choices` choices, as the server merges them: the first one's usage only, and `timings`."""
    answer = orjson.loads(body)
    first = answer["choices"][0]
    answer["choices"] = [first, *({**first, "index": index} for index in range(1, choices))]
    answer["timings"] = timings
    return orjson.dumps(answer)


def _models(options: Options, created: int) -> dict[str, Any]:
    meta = {"vocab_type": 2, "n_vocab": 151936, "n_ctx_train": options.max_model_len, "n_embd": 2048}
    model = {"id": options.model, "object": "model", "created": created, "owned_by": "llamacpp", "meta": meta}
    listed = {"name": options.model, "model": options.model, "modified_at": "", "size": "", "digest": ""}
    return {"models": [listed], "object": "list", "data": [model]}


def _props(options: Options) -> dict[str, Any]:
    return {
        "default_generation_settings": {
            "n_ctx": options.max_model_len,
            "params": {"n_predict": -1, "temperature": 0.8, "top_k": 40, "top_p": 0.95},
        },
        "total_slots": options.max_batch,
        "model_path": f"/models/{options.model}.gguf",
        "chat_template": "{% for message in messages %}{{ message.content }}{% endfor %}",
        "build_info": BUILD,
    }


def _slots(engine: Engine) -> list[dict[str, Any]]:
    """`GET /slots`: each slot, busy ones first (the engine counts busy slots, not which)."""
    return [
        {"id": slot, "id_task": slot if slot < engine.running else -1, "n_ctx": engine.options.max_model_len,
         "speculative": False, "is_processing": slot < engine.running}
        for slot in range(engine.options.max_batch)
    ]  # fmt: skip


def _metrics(engine: Engine, clock: Clock) -> str:
    """Prometheus text as llama.cpp writes it: every family named in full (`_total` kept), no labels."""
    prompt_s, predict_s = clock.prompt_s, clock.predict_s
    computed = engine.prompt_tokens - engine.hits
    prompt_rate = computed / prompt_s if prompt_s else 0.0
    items = (
        ("counter", "prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", computed),
        ("counter", "prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", engine.hits),
        ("counter", "prompt_seconds_total", "Total time spent processing prompts", prompt_s),
        ("counter", "tokens_predicted_total", "Number of generation tokens processed", engine.generation_tokens),
        ("counter", "tokens_predicted_seconds_total", "Total time spent generating tokens", predict_s),
        ("counter", "n_decode_total", "Total number of llama_decode() calls", clock.decodes),
        ("counter", "n_tokens_max", "Largest observed sequence length (prompt + generation)", clock.tokens_max),
        ("gauge", "prompt_tokens_seconds", "Average prompt throughput in tokens/s", prompt_rate),
        ("gauge", "predicted_tokens_seconds", "Average generation throughput in tokens/s",
         engine.generation_tokens / predict_s if predict_s else 0),
        ("gauge", "requests_processing", "Number of requests processing", engine.running),
        ("gauge", "requests_deferred", "Number of requests deferred", len(engine.waiting)),
        ("gauge", "n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
         clock.busy / max(1, clock.decodes)),
    )  # fmt: skip
    lines = []
    for kind, name, text, value in items:
        lines += [f"# HELP llamacpp:{name} {text}", f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {value}"]
    return "\n".join(lines) + "\n"
