"""The Responses API end to end: the `openai` SDK through the gateway to a Responses-capable scripted upstream."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from plugins.auth.keys import new_key
from tests.integration.gateway.test_telemetry import OtlpReceiver, children, metric, scrape
from tests.support.gateway import RunningGateway, gateway_thread
from tests.support.upstream import Ok, ScriptedUpstream, Status

KEY, KEY_HASH = new_key()
OTHER_KEY, OTHER_HASH = new_key()


def config(upstream: str, extra: str = "") -> str:
    return f"""
backends:
  up: {{type: openai, base_url: "{upstream}/v1", api_key: backend-key}}
  chatonly: {{type: openai, base_url: "{upstream}/v1", responses_api: false}}
pool: {{warm_connections: 1}}
models:
  gpt: {{backend: up, fallback: [old]}}
  old: {{backend: chatonly}}
tenants:
  acme: {{keys: ["{KEY_HASH}"]}}
  rival: {{keys: ["{OTHER_HASH}"]}}
plugins: [auth, cache]
{extra}
"""


@pytest.fixture()
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream(default=Ok(ttft_ms=30, tpot_ms=3, tokens=6)) as up:
        yield up


@pytest.fixture()
def gateway(upstream: ScriptedUpstream) -> Iterator[RunningGateway]:
    with gateway_thread(config(upstream.url)) as gw:
        yield gw


def sdk(gw: RunningGateway, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)


def responses_requests(up: ScriptedUpstream) -> list[Any]:
    return [r for r in up.requests if "/responses" in r.path]


def test_the_sdk_gets_the_same_response_and_events_as_direct(
    gateway: RunningGateway, upstream: ScriptedUpstream
) -> None:
    body = {"model": "gpt", "input": "What is a sluice?", "stream": True}
    auth = {"authorization": f"Bearer {KEY}"}
    via = httpx.post(f"{gateway.base_url}/responses", json=body, headers=auth, timeout=10)
    direct = httpx.post(f"{upstream.url}/v1/responses", json=body, timeout=10)
    assert via.status_code == direct.status_code == 200
    assert via.headers["content-type"] == "text/event-stream"
    assert via.headers["x-accel-buffering"] == "no"
    assert via.content == direct.content  # the events pass through byte for byte

    client = sdk(gateway)
    events = list(client.responses.create(model="gpt", input="What is a sluice?", stream=True))
    assert [e.type for e in events[:4]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed"
    assert events[-1].response.usage is not None
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "tok0 tok1 tok2 tok3 tok4 tok5"

    whole = client.responses.create(model="gpt", input="What is a sluice?")
    direct_whole = openai.OpenAI(base_url=f"{upstream.url}/v1", api_key="x", max_retries=0).responses.create(
        model="gpt", input="What is a sluice?"
    )
    assert whole.model_dump() == direct_whole.model_dump()
    assert whole.output_text == "tok0 tok1 tok2 tok3 tok4 tok5"
    assert whole.usage is not None
    assert upstream.requests[-2].headers["authorization"] == "Bearer backend-key"  # the client's key stays here


def test_retrieve_input_items_cancel_and_delete_pass_through(
    gateway: RunningGateway, upstream: ScriptedUpstream
) -> None:
    client = sdk(gateway)
    made = client.responses.create(model="gpt", input="hello")
    assert client.responses.retrieve(made.id).output_text == made.output_text
    items = client.responses.input_items.list(made.id)
    assert [item.type for item in items.data] == ["message"]
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(made.id)  # not a background response: the upstream's answer, as it gave it
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    seen = [(r.method, r.path) for r in responses_requests(upstream)]
    assert seen == [
        ("POST", "/v1/responses"),
        ("GET", f"/v1/responses/{made.id}"),
        ("GET", f"/v1/responses/{made.id}/input_items"),
        ("POST", f"/v1/responses/{made.id}/cancel"),
        ("DELETE", f"/v1/responses/{made.id}"),
    ]  # once deleted, its owner record is gone: the retrieval after it is a 404 made here
    assert all(r.body == b"" for r in responses_requests(upstream)[1:])


def test_another_tenant_cannot_see_a_response(gateway: RunningGateway, upstream: ScriptedUpstream) -> None:
    made = sdk(gateway).responses.create(model="gpt", input="private")
    rival = sdk(gateway, OTHER_KEY)
    for call in (
        lambda: rival.responses.retrieve(made.id),
        lambda: rival.responses.delete(made.id),
        lambda: rival.responses.cancel(made.id),
        lambda: rival.responses.input_items.list(made.id),
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.body == {
            "message": f"Response with id '{made.id}' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": None,
        }
    assert len(responses_requests(upstream)) == 1  # none of those reached the backend
    assert sdk(gateway).responses.retrieve(made.id).id == made.id
    anonymous = httpx.get(f"{gateway.base_url}/responses/{made.id}", timeout=5)
    assert anonymous.status_code == 401


def test_bad_paths_and_methods(gateway: RunningGateway) -> None:
    auth = {"authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{gateway.base_url}/responses/resp_1/nonsense", headers=auth).status_code == 404
    wrong = httpx.put(f"{gateway.base_url}/responses/resp_1", headers=auth)
    assert wrong.status_code == 405
    assert wrong.headers["allow"] == "GET, DELETE"
    assert httpx.get(f"{gateway.base_url}/responses", headers=auth).status_code == 405
    missing = httpx.post(f"{gateway.base_url}/responses", json={"model": "gpt"}, headers=auth)
    assert missing.status_code == 400
    assert missing.json()["error"]["param"] == "input"
    body = {"model": "gpt", "input": "x", "background": 1}
    bad = httpx.post(f"{gateway.base_url}/responses", json=body, headers=auth)
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "background"


def test_a_chat_only_backend_is_never_used_for_responses(gateway: RunningGateway, upstream: ScriptedUpstream) -> None:
    client = sdk(gateway)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="old", input="hi")
    assert "has no Responses API" in caught.value.message
    assert len(upstream.requests) == 0
    # The primary fails; its fallback is chat-only, so it is skipped rather than sent a translated request.
    upstream.script(Status(503))
    with pytest.raises(openai.InternalServerError):
        client.responses.create(model="gpt", input="hi")
    assert [r.path for r in upstream.requests] == ["/v1/responses"]
    # Chat completions still fall back to it.
    upstream.script(Status(503))
    chat = client.chat.completions.create(model="gpt", messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content
    assert upstream.requests[-1].json["model"] == "old"


def test_a_deterministic_repeat_is_a_cache_hit_and_a_chain_is_its_own_key(
    gateway: RunningGateway, upstream: ScriptedUpstream
) -> None:
    client = sdk(gateway)
    first = client.responses.with_raw_response.create(model="gpt", input="cache me", temperature=0)
    assert first.headers["x-sluice-cache"] == "miss"
    deadline = time.monotonic() + 5
    while True:  # the entry is written after the response has ended
        again = client.responses.with_raw_response.create(model="gpt", input="cache me", temperature=0)
        if again.headers["x-sluice-cache"] == "hit" or time.monotonic() > deadline:
            break
    assert again.headers["x-sluice-cache"] == "hit"
    assert again.parse().model_dump() == first.parse().model_dump()
    streamed = list(client.responses.create(model="gpt", input="cache me", temperature=0, stream=True))
    assert streamed[-1].type == "response.completed"
    assert streamed[-1].response.id == first.parse().id
    text = "".join(e.delta for e in streamed if e.type == "response.output_text.delta")
    assert text == first.parse().output_text
    assert len(responses_requests(upstream)) == 1
    # previous_response_id is part of the key: a follow-up in a chain is not the same request.
    chained = client.responses.with_raw_response.create(
        model="gpt", input="cache me", temperature=0, previous_response_id=first.parse().id
    )
    assert chained.headers["x-sluice-cache"] == "miss"
    assert len(responses_requests(upstream)) == 2
    # So is `store`: an answer that cannot be retrieved later is not one that can.
    unstored = client.responses.with_raw_response.create(model="gpt", input="cache me", temperature=0, store=False)
    assert unstored.headers["x-sluice-cache"] == "miss"
    assert len(responses_requests(upstream)) == 3
    # A retrieval is never cached.
    got = client.responses.with_raw_response.retrieve(first.parse().id)
    assert got.headers["x-sluice-cache"] == "bypass"


def test_azure_paths_for_both_api_forms(upstream: ScriptedUpstream) -> None:
    text = f"""
backends:
  dated: {{type: azure, base_url: "{upstream.url}", api_key: k, api_version: 2025-04-01-preview}}
  v1: {{type: azure, base_url: "{upstream.url}", api_key: k, api_version: v1}}
models:
  a-dated: {{backend: dated, upstream_model: dep1}}
  a-v1: {{backend: v1, upstream_model: dep2}}
tenants:
  acme: {{keys: ["{KEY_HASH}"]}}
plugins: [auth]
"""
    with gateway_thread(text) as gw:
        client = sdk(gw)
        made = client.responses.create(model="a-dated", input="hi")
        client.responses.retrieve(made.id)
        client.responses.create(model="a-v1", input="hi")
    seen = [(r.path, r.query.get("api-version"), (r.json or {}).get("model")) for r in upstream.requests]
    assert seen == [
        ("/openai/responses", "2025-04-01-preview", "dep1"),
        (f"/openai/responses/{made.id}", "2025-04-01-preview", None),
        ("/openai/v1/responses", None, "dep2"),
    ]


def test_ttft_metric_and_span_for_a_responses_stream(
    monkeypatch: pytest.MonkeyPatch, upstream: ScriptedUpstream
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    receiver = OtlpReceiver()
    try:
        with gateway_thread(config(upstream.url, f'telemetry: {{otlp_endpoint: "{receiver.url}"}}')) as gw:
            events = list(sdk(gw).responses.create(model="gpt", input="time me", stream=True))
            assert events[-1].type == "response.completed"
            samples = scrape(gw)
            spans = receiver.request(upstream.requests[-1].headers["x-request-id"], 8)
    finally:
        receiver.close()
    assert metric(samples, "sluice_time_to_first_token_seconds_count", model="gpt") == 1
    assert metric(samples, "sluice_time_per_output_token_seconds_count", model="gpt") == 1
    assert metric(samples, "sluice_tokens_total", direction="output") == 6
    root = spans["POST /v1/responses"]
    assert root.attributes["http.route"] == "/v1/responses"
    assert root.attributes["sluice.ttft_ms"] >= 30.0
    client_span = spans["chat gpt"]
    assert children(spans, client_span) == {"upstream", "stream"}
    assert "pool" in spans
    ((event, _),) = spans["stream"].events
    assert event == "first_token"
    assert client_span.attributes["gen_ai.usage.output_tokens"] == 6
    assert client_span.attributes["gen_ai.usage.input_tokens"] == 2  # "time me"


def test_the_simulated_backend_speaks_the_responses_api() -> None:
    text = """
backends:
  sim: {type: simulated, ttft_ms: 10, tpot_ms: 1, tokens: 5}
models:
  m: {backend: sim}
"""
    with gateway_thread(text) as gw:
        client = sdk(gw, "none")
        whole = client.responses.create(model="m", input="hello there", max_output_tokens=3)
        assert whole.status == "incomplete"
        assert len(whole.output_text.split()) == 3
        assert whole.usage is not None
        assert whole.usage.output_tokens == 3
        events = list(client.responses.create(model="m", input="hello there", stream=True))
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        assert len(deltas) == 5
        assert [e.sequence_number for e in events] == list(range(len(events)))
        done = events[-1]
        assert done.type == "response.completed"
        assert done.response.output_text == "".join(e.delta for e in deltas)
        assert client.responses.retrieve(done.response.id).output_text == done.response.output_text


def test_fallback_and_token_limits_work_as_for_chat(upstream: ScriptedUpstream) -> None:
    text = f"""
backends:
  a: {{type: openai, base_url: "{upstream.url}/v1"}}
  b: {{type: vllm, base_url: "{upstream.url}/v1"}}
models:
  gpt: {{backend: a, fallback: [local]}}
  local: {{backend: b, upstream_model: served-local}}
tenants:
  acme: {{keys: ["{KEY_HASH}"], rate_limit: {{tokens_per_minute: 1000}}}}
plugins: [auth, rate_limit]
"""
    with gateway_thread(text) as gw:
        client = sdk(gw)
        upstream.script(Status(503))
        served = client.responses.with_raw_response.create(model="gpt", input="one two three", max_output_tokens=50)
        assert served.headers["x-sluice-model"] == "local"
        assert served.headers["x-sluice-fallback"] == "error"
        assert upstream.requests[-1].json["model"] == "served-local"
        # The reservation (body / 4 + max_output_tokens) is corrected to the usage's total_tokens: 3 + 6.
        after = client.responses.with_raw_response.create(model="gpt", input="x", max_output_tokens=1)
        remaining = int(after.headers["x-ratelimit-remaining-tokens"])
        reserved = len(b'{"input":"x","max_output_tokens":1,"model":"gpt"}') // 4 + 1
        assert remaining == pytest.approx(1000 - 9 - reserved, abs=2)
