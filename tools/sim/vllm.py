"""A stand-in for vLLM's OpenAI-compatible server (`vllm serve`), on the replica model of `sim_engine`.

Paths, as vLLM serves them (docs.vllm.ai, "OpenAI-Compatible Server" and "Production Metrics"):
`GET /health` (200, empty body, once the engine is up), `GET /v1/models`, `GET /version`, `GET /metrics`
(Prometheus text), `POST /v1/chat/completions` and `POST /v1/completions`.

Behaviour that matters to a router:

- Start-up: the API server binds its port only after the model is loaded, so for `load_ms` connections are
  refused rather than answered 503.
- `stream_options.include_usage` is honoured (a final chunk with empty `choices` and the usage), and usage
  reports `prompt_count_details.cached_tokens`, the prefix-cache hit. As in vLLM's `protocol.py`,
  `include_usage` defaults to true once `stream_options` is given, and a non-empty `stream_options` on a
  request that does not stream is a 400 ("Stream options can only be defined when `stream=True`.").
  Not modelled: `continuous_usage_stats`.
- The context limit: a prompt plus `max_tokens` beyond `--max-model-len` is a 400 BadRequestError naming both
  counts; without `max_tokens`, only a prompt longer than the limit is refused.
- Metrics, labelled `model_name` (and `engine="0"` as vLLM V1 does): `vllm:num_requests_running`,
  `vllm:num_requests_waiting` (a preempted request counts as waiting again), `vllm:num_preemptions_total`,
  `vllm:kv_cache_usage_perc` and its older name `vllm:gpu_cache_usage_perc`,
  `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` (in tokens),
  `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from tools.sim.engine import (
    Engine,
    Options,
    Replica,
    metric_lines,
    openai,
    prompt_count,
    stats_response,
)
from tools.sim.httpd import Request, Response, json_response

VERSION = "0.9.2"
PREEMPTIONS = "Cumulative number of preemption from the engine."
_ENDPOINTS = {"/v1/chat/completions": "chat/completions", "/v1/completions": "completions"}


def build(options: Options, replica: int) -> Replica:
    engine = Engine(options, replica)
    created = int(time.time())

    async def handle(request: Request) -> Response:
        path = request.path
        if path == "/health":
            return Response(200, b"", "text/plain")
        if path == "/v1/models":
            return json_response(200, _models(options, created))
        if path == "/version":
            return json_response(200, {"version": VERSION})
        if path == "/metrics":
            return Response(200, metrics(engine).encode(), "text/plain; version=0.0.4")
        if path == "/_sim/stats":
            return stats_response(engine)
        endpoint = _ENDPOINTS.get(path)
        if endpoint is None:
            return json_response(404, {"detail": "Not Found"})
        if request.method != "POST":
            return json_response(405, {"detail": "Method Not Allowed"})
        try:
            body = request.json()
        except ValueError:
            return error(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        if body.get("model", options.model) != options.model:
            return error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        options_given = body.get("stream_options")
        if options_given and not body.get("stream"):
            return error(400, "Stream options can only be defined when `stream=True`.")
        if isinstance(options_given, dict) and "include_usage" not in options_given:
            body = {**body, "stream_options": {**options_given, "include_usage": True}}  # vLLM's default
        refusal = _context_check(options, endpoint, body)
        return refusal or await openai(engine, endpoint, body, options.model, _reshape)

    return Replica(handle, engine, options.load_ms / 1000.0)


def error(status: int, message: str, kind: str = "BadRequestError") -> Response:
    return json_response(status, {"error": {"message": message, "type": kind, "param": None, "code": status}})


def _reshape(status: int, body: bytes) -> Response:
    """The simulation's refusal, typed as vLLM types its errors."""
    return error(status, orjson.loads(body)["error"]["message"])


def _context_check(options: Options, endpoint: str, body: dict[str, Any]) -> Response | None:
    count = prompt_count(endpoint, body)
    if count is None:
        return None  # the simulation's own validation answers
    limit = options.max_model_len
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    if type(asked) is int and count + asked > limit:
        return error(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested {count + asked} "
            f"tokens ({count} in the messages, {asked} in the completion). Please reduce the length of the "
            "messages or completion.",
        )
    if count > limit:
        return error(
            400,
            f"This model's maximum context length is {limit} tokens. However, your request has {count} input "
            "tokens. Please reduce the length of the input messages.",
        )
    return None


def _models(options: Options, created: int) -> dict[str, Any]:
    model = {
        "id": options.model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": options.model,
        "parent": None,
        "max_model_len": options.max_model_len,
    }
    return {"object": "list", "data": [model]}


def metrics(engine: Engine) -> str:
    labels = f'engine="0",model_name="{engine.options.model}"'
    lines: list[str] = []
    for name, kind, text, value in (
        ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", engine.running),
        ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", len(engine.waiting)),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", engine.usage_ratio()),
        ("vllm:gpu_cache_usage_perc", "gauge", "GPU KV-cache usage. 1 means 100 percent usage.", engine.usage_ratio()),
        ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of tokens.", engine.queries),
        ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of tokens.", engine.hits),
        ("vllm:num_preemptions_total", "counter", PREEMPTIONS, engine.preemptions),
        ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", engine.prompt_tokens),
        ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", engine.generation_tokens),
    ):
        lines += metric_lines(name, kind, text, value, labels)
    return "\n".join(lines) + "\n"
