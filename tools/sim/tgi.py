"""A stand-in for Hugging Face Text Generation Inference (TGI) and its Messages API, on the replica model.

Paths, as `router/src/server.rs` of huggingface/text-generation-inference routes them: `GET /health` (200,
empty body), `GET /info` (the model and router limits), `GET /v1/models` (`created` 0, `owned_by` the model
id), `POST /v1/chat/completions`, `POST /v1/completions`, `GET /metrics` (`tgi_queue_size`,
`tgi_batch_current_size`).

Quirks a gateway meets, with where they come from:

- Start-up: the launcher (`launcher/src/main.rs`) spawns the webserver, and so opens the port, only once
  the shards report ready, so for `load_ms` connections are refused.
- `model` and `n` are read and ignored: both are marked UNUSED on `ChatRequest` (`router/src/lib.rs`);
  answers name the served model id and carry one choice.
- `stream_options.include_usage` is honoured, in the shape of the release stood in for (`server_version`,
  3.0.1 unless told): from 2.3 to 3.1 the usage rides on the last content chunk, the one with the finish
  reason; from 3.2 it is a chunk of its own, with empty `choices`, before `[DONE]`. Releases before 2.3
  (huggingface/text-generation-inference#2531) sent none.
- Token limits are validated, and a refusal is TGI's own error shape, not OpenAI's: status 422 with
  `{"error": "Input validation error: ...", "error_type": "validation"}` (`router/src/validation.rs`), when
  the prompt reaches `max_input_tokens` or prompt + `max_tokens` exceeds `max_total_tokens`
  (`--max-model-len`).
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.wire.completion import sse
from tools.sim.engine import Engine, Options, Replica, metric_lines, openai, prompt_count, stats_response
from tools.sim.httpd import Request, Response, json_response

VERSION = "3.0.1"
_IGNORED = ("model", "n")
_ENDPOINTS = {"/v1/chat/completions": "chat/completions", "/v1/completions": "completions"}


def build(options: Options, replica: int) -> Replica:
    engine = Engine(options, replica)
    version = options.server_version or VERSION
    ending = inline_usage if _release(version) < (3, 2) else None

    async def handle(request: Request) -> Response:
        path = request.path
        if path == "/health":
            return Response(200, b"", "text/plain")
        if path == "/info":
            return json_response(200, info(options, version))
        if path == "/v1/models":
            model = {"id": options.model, "object": "model", "created": 0, "owned_by": options.model}
            return json_response(200, {"object": "list", "data": [model]})
        if path == "/metrics":
            return Response(200, _metrics(engine).encode(), "text/plain; version=0.0.4")
        if path == "/_sim/stats":
            return stats_response(engine)
        endpoint = _ENDPOINTS.get(path)
        if endpoint is None:
            return Response(404, b"", "text/plain")
        if request.method != "POST":
            return Response(405, b"", "text/plain")
        try:
            body = request.json()
        except ValueError as exc:
            return validation(f"Failed to deserialize the JSON body into the target type: {exc}")
        if not isinstance(body, dict):
            return validation("Failed to deserialize the JSON body into the target type: expected a map")
        body = {key: value for key, value in body.items() if key not in _IGNORED}
        refusal = _limits(options, endpoint, body)
        return refusal or await openai(
            engine, endpoint, body, options.model, _reshape, report_cached=False, ending=ending
        )

    return Replica(handle, engine, options.load_ms / 1000.0)


def info(options: Options, version: str = VERSION) -> dict[str, Any]:
    return {
        "model_id": options.model,
        "model_sha": None,
        "model_dtype": "torch.float16",
        "model_device_type": "cuda",
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": 128,
        "max_best_of": 2,
        "max_stop_sequences": 4,
        "max_input_tokens": options.max_model_len - 1,
        "max_total_tokens": options.max_model_len,
        "validation_workers": 2,
        "max_client_batch_size": 4,
        "router": "text-generation-router",
        "version": version,
        "sha": None,
        "docker_label": None,
    }


def inline_usage(events: list[bytes]) -> list[bytes]:
    """TGI 2.3 to 3.1: the usage chunk's usage put on the finish chunk before it, and no usage chunk."""
    if len(events) < 3:
        return events  # no usage was asked for
    finish, usage, *rest = events
    payload = orjson.loads(finish.removeprefix(b"data: ").rstrip())
    payload["usage"] = orjson.loads(usage.removeprefix(b"data: ").rstrip())["usage"]
    return [sse(orjson.dumps(payload)), *rest]


def _release(version: str) -> tuple[int, ...]:
    """ "3.0.1" as (3, 0, 1); what is not a number counts as 0."""
    return tuple(int(part) if part.isdigit() else 0 for part in version.split(".")[:3])


def validation(message: str) -> Response:
    return json_response(422, {"error": message, "error_type": "validation"})


def _reshape(status: int, body: bytes) -> Response:
    """The simulation's OpenAI-shaped refusal, as TGI words a validation error."""
    message = orjson.loads(body)["error"]["message"]
    return validation(f"Input validation error: {message}") if status == 400 else Response(status, body)


def _limits(options: Options, endpoint: str, body: dict[str, Any]) -> Response | None:
    count = prompt_count(endpoint, body)
    if count is None:
        return None  # the simulation's own validation answers
    total = options.max_model_len
    if count >= total:
        return validation(f"Input validation error: `inputs` must have less than {total - 1} tokens. Given: {count}")
    asked = body.get("max_tokens")
    if type(asked) is int and count + asked > total:
        return validation(
            f"Input validation error: `inputs` tokens + `max_new_tokens` must be <= {total}. "
            f"Given: {count} `inputs` tokens and {asked} `max_new_tokens`"
        )
    return None


def _metrics(engine: Engine) -> str:
    lines: list[str] = []
    for name, text, value in (
        ("tgi_queue_size", "Current queue size", len(engine.waiting)),
        ("tgi_batch_current_size", "Current batch size", engine.running),
    ):
        lines += metric_lines(name, "gauge", text, value, "")
    return "\n".join(lines) + "\n"
