"""Priority classes and the gateway's queue, end to end: the gateway under uvicorn in front of real HTTP upstreams
whose capacity it is told (`admission.backends.NAME.max_in_flight`).

Order of service is read where it happens: the order in which requests reach the upstream, one at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from plugins.auth.keys import new_key
from tests.support.gateway import RunningGateway, gateway_thread
from tests.support.llamacpp import gateway_metric, wait_for
from tests.support.standins import standin
from tests.support.upstream import Ok, ScriptedUpstream

TOP, TOP_HASH = new_key()
STD, STD_HASH = new_key()
BULK, BULK_HASH = new_key()
HEAVY, HEAVY_HASH = new_key()  # standard, weight 2
LIGHT, LIGHT_HASH = new_key()  # standard, weight 1
BLOCK_MS = 2500  # a request that holds the backend's one slot while others queue behind it


def config(url: str, kind: str = "openai", capacity: str = "oa: {max_in_flight: 1}", extra: str = "") -> str:
    return f"""
backends:
  oa: {{type: {kind}, base_url: "{url}/v1", api_key: sk-backend}}
  ob: {{type: {kind}, base_url: "{url}/v1", api_key: sk-backend}}
pool: {{max_connections: 16, warm_connections: 0}}
models:
  chat: {{backend: oa, upstream_model: sim}}
  spilling: {{backend: oa, upstream_model: sim, fallback: [spare]}}
  spare: {{backend: ob, upstream_model: sim}}
tenants:
  top: {{keys: ["{TOP_HASH}"], priority: {{class: interactive}}}}
  std: {{keys: ["{STD_HASH}"], priority: {{class: standard}}}}
  bulk: {{keys: ["{BULK_HASH}"], priority: {{class: batch, max_class: interactive}}}}
  heavy: {{keys: ["{HEAVY_HASH}"], priority: {{class: standard, weight: 2}}}}
  light: {{keys: ["{LIGHT_HASH}"], priority: {{class: standard}}}}
auth: {{required: true}}
admission:
  classes:
    - {{name: interactive, ttft_slo_ms: 60000, service_tier: priority, vllm_priority: 0, spill: true}}
    - {{name: standard, ttft_slo_ms: 60000}}
    - {{name: batch, ttft_slo_ms: 300, sheddable: true, service_tier: flex, vllm_priority: 10}}
  backends: {{{capacity}}}
{extra}
plugins: [auth, admission]
"""


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream(default=Ok(ttft_ms=20, tokens=2)) as up:
        yield up


@pytest.fixture(scope="module")
def gateway(upstream: ScriptedUpstream) -> Iterator[RunningGateway]:
    with gateway_thread(config(upstream.url)) as gw:
        yield gw


def post(gw: RunningGateway, key: str, tag: str, priority: str | None = None, **body: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    if priority is not None:
        headers["x-sluice-priority"] = priority
    payload = {"model": "chat", "messages": [{"role": "user", "content": tag}], **body}
    return httpx.post(f"{gw.base_url}/chat/completions", json=payload, headers=headers, timeout=60)


class Sent:
    """A request in a thread of its own; `.response` once it is answered."""

    def __init__(
        self, gw: RunningGateway, key: str, tag: str, priority: str | None = None, model: str = "chat"
    ) -> None:
        self.response: httpx.Response | None = None
        self.thread = threading.Thread(target=self._run, args=(gw, key, tag, priority, model), daemon=True)
        self.thread.start()

    def _run(self, gw: RunningGateway, key: str, tag: str, priority: str | None, model: str) -> None:
        self.response = post(gw, key, tag, priority, model=model)

    def result(self) -> httpx.Response:
        self.thread.join(60)
        assert self.response is not None, "no answer"
        return self.response


def waiting(gw: RunningGateway) -> float:
    return gateway_metric(gw.url, "sluice_admission_waiting")


def tags_since(up: ScriptedUpstream, start: int) -> list[str]:
    return [r.json["messages"][0]["content"] for r in up.requests[start:]]


def block(gw: RunningGateway, up: ScriptedUpstream, key: str = TOP, ms: float = BLOCK_MS) -> Sent:
    """Hold the backend's only slot with a slow answer; return once the upstream has it."""
    up.script(Ok(ttft_ms=ms, tokens=2))
    count = len(up.requests)
    blocker = Sent(gw, key, "blocker")
    wait_for(lambda: len(up.requests) > count, 10, "the blocker reaching the upstream")
    return blocker


def queue(gw: RunningGateway, sends: list[tuple[str, str]]) -> list[Sent]:
    """Send (key, tag) one after another, each once the one before is waiting at the gateway."""
    out: list[Sent] = []
    for key, tag in sends:
        out.append(Sent(gw, key, tag))
        wait_for(lambda: waiting(gw) >= len(out), 10, f"{tag} waiting at the gateway")
    return out


def test_a_higher_class_is_served_first_when_a_slot_frees(gateway: RunningGateway, upstream: ScriptedUpstream) -> None:
    start = len(upstream.requests)
    blocker = block(gateway, upstream, ms=4000)  # long enough for the queue to be built behind it
    queued = queue(gateway, [(STD, "std-1"), (STD, "std-2"), (TOP, "top-1")])
    assert blocker.thread.is_alive(), "the blocker ended before the queue was built"
    assert blocker.result().status_code == 200
    answers = [s.result() for s in queued]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert tags_since(upstream, start) == ["blocker", "top-1", "std-1", "std-2"]
    assert [a.headers["x-sluice-priority"] for a in answers] == ["standard", "standard", "interactive"]
    assert gateway_metric(gateway.url, "sluice_admission_queued_total", priority="interactive") >= 1


def test_tenants_of_a_class_take_turns_by_weight(gateway: RunningGateway, upstream: ScriptedUpstream) -> None:
    start = len(upstream.requests)
    blocker = block(gateway, upstream, ms=6000)
    sends = [(HEAVY, f"heavy-{i}") for i in range(1, 5)] + [(LIGHT, f"light-{i}") for i in range(1, 3)]
    queued = queue(gateway, sends)
    assert blocker.thread.is_alive(), "the blocker ended before the queue was built"
    blocker.result()
    assert all(s.result().status_code == 200 for s in queued)
    # heavy has weight 2: two turns of its, then one of light's, while both have requests waiting.
    expected = ["blocker", "heavy-1", "heavy-2", "light-1", "heavy-3", "heavy-4", "light-2"]
    assert tags_since(upstream, start) == expected


def test_a_tenant_asks_for_a_class_within_what_it_may_use(gateway: RunningGateway, upstream: ScriptedUpstream) -> None:
    # std's highest class is its own: asking above it is clamped (the default), asking below is granted.
    assert post(gateway, STD, "x", "interactive").headers["x-sluice-priority"] == "standard"
    assert post(gateway, STD, "x", "batch").headers["x-sluice-priority"] == "batch"
    # bulk runs as batch unless it asks, and may ask up to interactive.
    assert post(gateway, BULK, "x").headers["x-sluice-priority"] == "batch"
    assert post(gateway, BULK, "x", "Interactive").headers["x-sluice-priority"] == "interactive"
    refused = post(gateway, STD, "x", "urgent")
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "unknown_priority"
    assert error["param"] == "x-sluice-priority"
    assert "interactive, standard, batch" in error["message"]


def test_the_class_goes_upstream_as_service_tier(gateway: RunningGateway, upstream: ScriptedUpstream) -> None:
    answer = post(gateway, TOP, "tiered")
    assert answer.status_code == 200
    assert upstream.requests[-1].json["service_tier"] == "priority"
    assert answer.headers["x-sluice-service-tier"] == "priority"
    plain = post(gateway, STD, "plain")
    assert "service_tier" not in upstream.requests[-1].json
    assert "x-sluice-service-tier" not in plain.headers
    # Embeddings have no service tier at OpenAI (it refuses the field): the body goes as the client sent it.
    embedded = httpx.post(
        f"{gateway.base_url}/embeddings",
        json={"model": "chat", "input": "text"},
        headers={"authorization": f"Bearer {TOP}"},
        timeout=30,
    )
    assert embedded.status_code == 200
    assert upstream.requests[-1].json == {"model": "sim", "input": "text"}


def test_a_sheddable_class_is_refused_and_the_top_class_waits(upstream: ScriptedUpstream) -> None:
    with gateway_thread(config(upstream.url)) as gw:
        client = openai.OpenAI(api_key=BULK, base_url=gw.base_url, max_retries=0)
        messages: Any = [{"role": "user", "content": "shed me"}]
        # Nothing measured yet: the batch request queues, and is refused once it has waited its SLO.
        blocker = block(gw, upstream)
        with pytest.raises(openai.InternalServerError) as waited:
            client.chat.completions.create(model="chat", messages=messages)
        assert waited.value.status_code == 503
        assert waited.value.code == "priority_shed"
        assert "waited" in waited.value.message
        assert blocker.result().status_code == 200
        # Measured now: a slot is held about BLOCK_MS, so a queued batch request is refused at once.
        blocker = block(gw, upstream)
        top = queue(gw, [(TOP, "top waits")])[0]
        with pytest.raises(openai.InternalServerError) as shed:
            client.chat.completions.create(model="chat", messages=messages)
        assert blocker.thread.is_alive(), "the refusal waited for the slot instead of coming at once"
        error = shed.value
        assert error.status_code == 503
        assert error.code == "priority_shed"
        assert error.type == "overloaded_error"
        assert "backend 'oa' is saturated" in error.message
        assert "'batch'" in error.message
        assert int(error.response.headers["retry-after"]) >= 1
        assert int(error.response.headers["retry-after-ms"]) >= 1000
        assert error.response.headers["x-request-id"]
        body = error.response.json()
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert top.result().status_code == 200  # not sheddable: it waited and was served
        assert gateway_metric(gw.url, "sluice_admission_shed_total", reason="waited", priority="batch") == 1
        assert gateway_metric(gw.url, "sluice_admission_shed_total", reason="predicted", priority="batch") == 1


def test_refuse_mode_answers_403_above_the_tenants_class(upstream: ScriptedUpstream) -> None:
    with gateway_thread(config(upstream.url, extra="  above_allowed: refuse")) as gw:
        refused = post(gw, STD, "x", "interactive")
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "priority_not_allowed"
        assert post(gw, STD, "x", "standard").status_code == 200


def test_the_simulated_vllm_serves_by_the_priority_the_class_sends() -> None:
    # No gate at the gateway here: the requests pile up in the engine, whose one batch slot goes by priority.
    # The blocker generates 100 tokens at 20 ms (two seconds); the others are cut to two by max_tokens.
    with (
        standin("vllm", max_batch=1, ttft_ms=20.0, tpot_ms=20.0, tokens=100) as sim,
        gateway_thread(config(sim.url, kind="vllm", capacity="")) as gw,
    ):
        done: list[str] = []
        lock = threading.Lock()

        def one(key: str, tag: str, priority: str | None = None, tokens: int = 2) -> threading.Thread:
            def run() -> None:
                assert post(gw, key, tag, priority, max_tokens=tokens).status_code == 200
                with lock:
                    done.append(tag)

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            return thread

        threads = [one(BULK, "blocker", tokens=100)]
        wait_for(lambda: sim.stats()["running"] == 1, 10, "the blocker running")
        threads.append(one(BULK, "batch"))
        wait_for(lambda: sim.stats()["waiting"] == 1, 10, "the batch request waiting in the engine")
        threads.append(one(BULK, "interactive", "interactive"))
        wait_for(lambda: sim.stats()["waiting"] == 2, 10, "both waiting in the engine")
        for thread in threads:
            thread.join(30)
        assert done[1:] == ["interactive", "batch"]


def test_a_background_job_goes_up_in_the_lowest_class(gateway: RunningGateway, upstream: ScriptedUpstream) -> None:
    # top's own class is interactive, but a background job runs as batch: `service_tier: flex` upstream.
    count = len(upstream.requests)
    headers = {"authorization": f"Bearer {TOP}", "x-sluice-background": "true"}
    body = {"model": "chat", "messages": [{"role": "user", "content": "later"}]}
    accepted = httpx.post(f"{gateway.base_url}/chat/completions", json=body, headers=headers, timeout=30)
    assert accepted.status_code == 202
    wait_for(lambda: len(upstream.requests) > count, 10, "the job's request reaching the upstream")
    assert upstream.requests[count].json["service_tier"] == "flex"
    assert upstream.requests[count].json["messages"][0]["content"] == "later"


def test_a_stream_holds_its_slot_to_its_end_and_a_client_that_leaves_gives_up_its_place(
    gateway: RunningGateway, upstream: ScriptedUpstream
) -> None:
    upstream.script(Ok(ttft_ms=50, tpot_ms=2000, tokens=4))  # six seconds of stream
    headers = {"authorization": f"Bearer {STD}"}
    body = {"model": "chat", "messages": [{"role": "user", "content": "stream"}], "stream": True}
    with httpx.stream("POST", f"{gateway.base_url}/chat/completions", json=body, headers=headers, timeout=30) as r:
        chunks = r.iter_raw()
        next(chunks)  # streaming: its slot is held
        # A request that comes now waits; its client leaves; the one after it is served once the stream ends.
        with httpx.Client(timeout=httpx.Timeout(30.0, read=0.5)) as leaving:
            payload = {"model": "chat", "messages": [{"role": "user", "content": "gone"}]}
            with pytest.raises(httpx.ReadTimeout):
                leaving.post(f"{gateway.base_url}/chat/completions", json=payload, headers=headers)
        wait_for(lambda: waiting(gateway) == 0, 10, "the place given up")
        after = queue(gateway, [(STD, "after")])[0]
        assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
    assert after.result().status_code == 200
    assert [r.json["messages"][0]["content"] for r in upstream.requests[-2:]] == ["stream", "after"]


def test_a_class_that_spills_takes_a_fallback_with_room_rather_than_wait(
    gateway: RunningGateway, upstream: ScriptedUpstream
) -> None:
    blocker = block(gateway, upstream)
    spilled = post(gateway, TOP, "spilled", model="spilling")
    assert blocker.thread.is_alive(), "it waited for the primary instead of going to the fallback"
    assert spilled.status_code == 200
    assert spilled.headers["x-sluice-model"] == "spare"
    assert spilled.headers["x-sluice-fallback"] == "overload"
    # standard does not spill: it waits for the primary.
    waits = Sent(gateway, STD, "waits", model="spilling")
    wait_for(lambda: waiting(gateway) >= 1, 10, "the standard request waiting")
    assert blocker.result().status_code == 200
    assert waits.result().headers["x-sluice-model"] == "spilling"
    assert "x-sluice-fallback" not in waits.result().headers
