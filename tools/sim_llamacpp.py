"""A stand-in for llama.cpp's `llama-server`, on the replica model (its slots are the batch).

Paths (github.com/ggml-org/llama.cpp, tools/server/README.md): `GET /health` and `/v1/health`,
`GET /v1/models`, `/models` and `/api/tags`, `GET /props`, `GET /metrics` (with `--metrics`),
`POST /v1/chat/completions` and `/chat/completions`, `POST /v1/completions` and `/completions`.

Behaviour a gateway meets, with where it comes from:

- Start-up: the port opens at once and, until the model is loaded (`load_ms`), every path but the model
  lists (`/models`, `/v1/models`, `/api/tags`, which the server's `middleware_server_state` lets through)
  answers 503 `{"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}`; then
  `/health` is 200 `{"status": "ok"}`.
- `n` other than 1 is refused: "Only one completion choice is allowed" (`oaicompat_chat_params_parse` in the
  server's utils); errors are `{"error": {"code", "message", "type"}}`.
- `model` is not checked: the server has one model and names it (its alias) in every answer.
- `stream_options.include_usage` is honoured (a final chunk with empty `choices` and the usage), and usage
  carries `prompt_tokens_details.cached_tokens`, the prompt-cache reuse.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from tools.sim_engine import Engine, Options, Replica, metric_lines, openai, stats_response
from tools.sim_http import Request, Response, json_response

BUILD = "b6000"
_ENDPOINTS = {
    "/v1/chat/completions": "chat/completions",
    "/chat/completions": "chat/completions",
    "/v1/completions": "completions",
    "/completions": "completions",
}
_LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}


def build(options: Options, replica: int) -> Replica:
    engine = Engine(options, replica)
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
        if path == "/metrics":
            return Response(200, _metrics(engine).encode(), "text/plain; version=0.0.4")
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
        if body.get("n", 1) != 1:
            return error(400, "Only one completion choice is allowed")
        return await openai(engine, endpoint, body, options.model, _reshape)

    return Replica(handle, engine)


def error(status: int, message: str, kind: str = "invalid_request_error") -> Response:
    return json_response(status, {"error": {"code": status, "message": message, "type": kind}})


def _reshape(status: int, body: bytes) -> Response:
    return error(status, orjson.loads(body)["error"]["message"])


def _models(options: Options, created: int) -> dict[str, Any]:
    meta = {"vocab_type": 2, "n_vocab": 151936, "n_ctx_train": options.max_model_len, "n_embd": 2048}
    model = {"id": options.model, "object": "model", "created": created, "owned_by": "llamacpp", "meta": meta}
    return {"object": "list", "data": [model]}


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


def _metrics(engine: Engine) -> str:
    lines: list[str] = []
    for name, kind, text, value in (
        ("llamacpp:prompt_tokens_total", "counter", "Number of prompt tokens processed.", engine.prompt_tokens),
        (
            "llamacpp:tokens_predicted_total",
            "counter",
            "Number of generation tokens.",
            engine.generation_tokens,
        ),
        ("llamacpp:kv_cache_usage_ratio", "gauge", "KV-cache usage. 1 means 100 percent usage.", engine.usage_ratio()),
        ("llamacpp:requests_processing", "gauge", "Number of requests processing.", engine.running),
        ("llamacpp:requests_deferred", "gauge", "Number of requests deferred.", len(engine.waiting)),
    ):
        lines += metric_lines(name, kind, text, value, "")
    return "\n".join(lines) + "\n"
