"""Warm-up on built targets: the requests each endpoint's warm-up sends, what a failure counts, and that a
timeout or an error status never raises (the gateway becomes ready whatever came of it)."""

from __future__ import annotations

import asyncio

import orjson

from gateway.config import parse
from gateway.context import Exchange, Target
from gateway.messages.backends import Canned
from gateway.telemetry.metrics import Meter, Metrics
from gateway.upstream.attempts import Upstreams
from gateway.upstream.providers.base import UpstreamResponse, View
from gateway.upstream.warmup import Warmup, _excerpt

CONFIG = """
backends: {sim: {type: simulated, ttft_ms: 0, tpot_ms: 0}}
models:
  chat: {backend: sim, upstream_model: small, warmup: {requests: 3, prompt: "Hi.", max_tokens: 2}}
  text: {backend: sim, warmup: {requests: 1, endpoint: completions}}
  vectors: {backend: sim, warmup: {requests: 2, endpoint: embeddings}}
  cold: {backend: sim}
"""


class Scripted(View):
    """The simulated backend seen through a script: records what was sent, answers each with the next status."""

    def __init__(self, upstreams: Upstreams, statuses: list[int], hold: asyncio.Event | None = None) -> None:
        super().__init__(upstreams.providers["sim"])
        self.statuses = statuses
        self.hold = hold
        self.sent: list[Exchange] = []

    async def send(self, ex: Exchange, target: Target) -> UpstreamResponse:
        self.sent.append(ex)
        if self.hold is not None:
            await self.hold.wait()
        status = self.statuses.pop(0) if self.statuses else 200
        body = b"{}" if status < 300 else orjson.dumps({"error": {"message": "model is loading"}})
        return Canned(status, body)


def build(statuses: list[int], hold: asyncio.Event | None = None) -> tuple[Warmup, Scripted]:
    settings = parse(CONFIG)
    upstreams = Upstreams(settings)
    scripted = Scripted(upstreams, statuses, hold)
    for model, t in list(upstreams.targets.items()):
        upstreams.targets[model] = Target(t.model, t.backend, t.upstream_model, t.settings, scripted)
    return Warmup(settings, upstreams, Meter(Metrics(settings.telemetry))), scripted


def test_only_models_with_a_warmup_are_planned() -> None:
    warmup, _ = build([])
    assert set(warmup.plans) == {"chat", "text", "vectors"}


async def test_each_endpoint_sends_its_own_small_request() -> None:
    warmup, scripted = build([])
    assert await warmup.warm("chat", "start-up") == 3
    assert await warmup.warm("text", "start-up") == 1
    assert await warmup.warm("vectors", "start-up") == 2
    chat, text, vectors = scripted.sent[0], scripted.sent[3], scripted.sent[4]
    assert chat.endpoint == "chat/completions"
    assert chat.json == {"model": "chat", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
    assert text.endpoint == "completions"
    assert set(text.json) == {"model", "prompt", "max_tokens"}
    assert vectors.endpoint == "embeddings"
    assert set(vectors.json) == {"model", "input"}
    assert all(ex.request_id.startswith("warmup-") for ex in scripted.sent)
    assert warmup.warmed == {"chat": 3, "text": 1, "vectors": 2}


async def test_an_error_status_stops_the_warmup_and_is_counted_never_raised() -> None:
    warmup, scripted = build([200, 503])
    assert await warmup.warm("chat", "start-up") == 1
    assert len(scripted.sent) == 2  # no third request after the failure
    assert await warmup.warm("chat", "back from down") == 3  # the script is spent: all succeed
    assert warmup.warmed["chat"] == 4


async def test_a_warmup_past_its_timeout_gives_up_without_raising() -> None:
    hold = asyncio.Event()  # never set: the backend never answers
    warmup, _ = build([], hold)
    warmup.plans["chat"] = warmup.plans["chat"].model_copy(update={"timeout_s": 0.05})
    assert await warmup.warm("chat", "start-up") == 0


def test_a_failure_is_shown_by_its_message() -> None:
    assert _excerpt(orjson.dumps({"error": {"message": "model is loading"}})) == "model is loading"
    assert _excerpt(b"Bad Gateway") == "Bad Gateway"
    assert _excerpt(b"") == "(no body)"
    assert _excerpt(b"[1]") == "[1]"
