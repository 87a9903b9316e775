"""Background mode end to end: jobs the gateway runs itself, polled, resumed and cancelled with the `openai` SDK."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest

from plugins.auth.keys import new_key
from tests.support.gateway import RunningGateway, gateway_process, gateway_thread
from tests.support.redis import RedisServer
from tests.support.upstream import Ok, ScriptedUpstream, Stall

KEY, KEY_HASH = new_key()
OTHER_KEY, OTHER_HASH = new_key()
T = TypeVar("T")


def config(backend: str, extra: str = "") -> str:
    return f"""
backends:
  up: {backend}
pool: {{warm_connections: 1}}
models:
  m: {{backend: up}}
tenants:
  acme: {{keys: ["{KEY_HASH}"]}}
  rival: {{keys: ["{OTHER_HASH}"]}}
plugins: [auth]
{extra}
"""


SLOW_SIM = "{type: simulated, ttft_ms: 20, tpot_ms: 20, tokens: 40}"


def sdk(gw: RunningGateway, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)


def until(check: Callable[[], T | None], timeout: float = 15.0, what: str = "the condition") -> T:
    """Poll `check` until it returns something, within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.05)


def finished(client: openai.OpenAI, ident: str, timeout: float = 15.0) -> Any:
    def check() -> Any:
        response = client.responses.retrieve(ident)
        return response if response.status not in ("queued", "in_progress") else None

    return until(check, timeout, f"the end of {ident}")


@pytest.fixture()
def sim() -> Iterator[RunningGateway]:
    with gateway_thread(config(SLOW_SIM)) as gw:
        yield gw


def test_a_background_response_is_polled_until_completed(sim: RunningGateway) -> None:
    client = sdk(sim)
    made = client.responses.create(model="m", input="tell me a story", background=True)
    assert made.id.startswith("resp_")
    assert made.status == "queued"
    assert made.background
    done = finished(client, made.id)
    assert done.status == "completed"
    assert done.id == made.id
    assert len(done.output_text.split()) == 40
    assert done.usage is not None
    assert done.usage.output_tokens == 40
    items = client.responses.input_items.list(made.id)
    assert [item.type for item in items.data] == ["message"]


def test_a_resumed_stream_gets_exactly_the_missing_events(sim: RunningGateway) -> None:
    client = sdk(sim)
    live = client.responses.create(model="m", input="stream it", background=True, stream=True)
    seen = []
    for event in live:  # leave mid-generation, as a dropped connection would
        seen.append(event)
        if event.type == "response.output_text.delta" and len(seen) > 10:
            break
    live.close()
    assert seen[0].type == "response.created"
    ident = seen[0].response.id
    last = seen[-1].sequence_number
    rest = list(client.responses.retrieve(ident, stream=True, starting_after=last))
    assert rest[0].sequence_number == last + 1
    assert rest[-1].type == "response.completed"
    every = list(client.responses.retrieve(ident, stream=True))
    assert [e.sequence_number for e in every] == list(range(len(every)))
    assert [e.model_dump() for e in seen + rest] == [e.model_dump() for e in every]
    text = "".join(e.delta for e in every if e.type == "response.output_text.delta")
    assert text == client.responses.retrieve(ident).output_text


def test_another_tenant_gets_a_404(sim: RunningGateway) -> None:
    made = sdk(sim).responses.create(model="m", input="mine", background=True)
    rival = sdk(sim, OTHER_KEY)
    with pytest.raises(openai.NotFoundError):
        rival.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        rival.responses.cancel(made.id)
    with pytest.raises(openai.NotFoundError):
        list(rival.responses.retrieve(made.id, stream=True, starting_after=0))
    assert finished(sdk(sim), made.id).status == "completed"  # the rival's cancel did nothing


def test_cancel_closes_the_upstream_and_the_cap_is_per_tenant() -> None:
    with ScriptedUpstream(default=Stall(after_chunks=5)) as up:
        backend = f'{{type: vllm, base_url: "{up.url}/v1"}}'
        with gateway_thread(config(backend, "background: {max_inflight_per_tenant: 1}")) as gw:
            client = sdk(gw)
            made = client.responses.create(model="m", input="long", background=True)
            until(lambda: client.responses.retrieve(made.id).status == "in_progress" or None, what="in_progress")
            with pytest.raises(openai.RateLimitError) as caught:
                client.responses.create(model="m", input="second", background=True)
            assert "background requests in flight" in caught.value.message
            sdk(gw, OTHER_KEY).responses.create(model="m", input="theirs", background=True)  # another tenant's cap
            # The model has gone quiet after five events: a follower still gets them, at once.
            live = openai.OpenAI(base_url=gw.base_url, api_key=KEY, max_retries=0, timeout=5).responses.retrieve(
                made.id, stream=True
            )
            events = iter(live)
            assert [next(events).sequence_number for _ in range(5)] == [0, 1, 2, 3, 4]
            live.close()
            assert client.responses.cancel(made.id).status == "cancelled"
            assert up.wait_disconnect(5.0), "the upstream generation was not stopped"
            assert client.responses.retrieve(made.id).status == "cancelled"
            replayed = list(client.responses.retrieve(made.id, stream=True))
            assert replayed[-1].type == "response.failed"
            assert replayed[-1].response.status == "cancelled"
            # The slot is free again once the job has ended.
            until(
                lambda: _created(client),
                what="a new job admitted",
            )
        sent = [r.json for r in up.requests if r.path == "/v1/responses"]
        assert sent[0]["stream"] is True
        assert "background" not in sent[0]  # the gateway streams it itself


def _created(client: openai.OpenAI) -> bool | None:
    try:
        client.responses.create(model="m", input="third", background=True)
    except openai.RateLimitError:
        return None
    return True


def test_a_native_backend_runs_its_own_background_mode() -> None:
    with (
        ScriptedUpstream(default=Ok(tokens=3)) as up,
        gateway_thread(config(f'{{type: openai, base_url: "{up.url}/v1"}}')) as gw,
    ):
        client = sdk(gw)
        made = client.responses.create(model="m", input="native", background=True)
        assert client.responses.retrieve(made.id).id == made.id
    assert up.requests[0].json["background"] is True
    assert [(r.method, r.path) for r in up.requests] == [("POST", "/v1/responses"), ("GET", f"/v1/responses/{made.id}")]


def test_background_chat_completions(sim: RunningGateway) -> None:
    auth = {"authorization": f"Bearer {KEY}"}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    accepted = httpx.post(
        f"{sim.base_url}/chat/completions", json=body, headers={**auth, "x-sluice-background": "true"}
    )
    assert accepted.status_code == 202
    job = accepted.json()
    location = accepted.headers["location"]
    assert location == f"/v1/sluice/background/{job['id']}"
    assert job["status"] == "queued"

    def done() -> dict[str, Any] | None:
        status = httpx.get(f"{sim.url}{location}", headers=auth).json()
        return status if status["status"] == "completed" else None

    status = until(done, what="the chat job's end")
    result = status["result"]
    assert result["object"] == "chat.completion"
    assert len(result["choices"][0]["message"]["content"].split()) == 40
    assert result["usage"]["completion_tokens"] == 40

    whole = httpx.get(f"{sim.url}{location}/events", headers=auth).text
    ids = [int(line[4:]) for line in whole.splitlines() if line.startswith("id: ")]
    assert ids == list(range(len(ids)))
    assert whole.endswith("data: [DONE]\n\n")
    resumed = httpx.get(f"{sim.url}{location}/events", headers={**auth, "last-event-id": str(ids[-5])}).text
    assert [int(line[4:]) for line in resumed.splitlines() if line.startswith("id: ")] == ids[-4:]
    assert whole.endswith(resumed)
    assert httpx.get(f"{sim.url}{location}", headers={"authorization": f"Bearer {OTHER_KEY}"}).status_code == 404
    # Each path reads its own kind of job.
    assert httpx.get(f"{sim.base_url}/responses/{job['id']}", headers=auth).status_code == 404
    made = sdk(sim).responses.create(model="m", input="x", background=True)
    assert httpx.get(f"{sim.base_url}/sluice/background/{made.id}", headers=auth).status_code == 404


def test_created_on_one_instance_resumed_on_another(redis_server: RedisServer, tmp_path: Path) -> None:
    text = config(SLOW_SIM, f'redis: {{url: "{redis_server.url}"}}')
    with gateway_process(text, tmp_path) as one, gateway_process(text, tmp_path) as two:
        made = sdk(one).responses.create(model="m", input="shared", background=True)
        other = sdk(two)
        done = finished(other, made.id)
        assert done.status == "completed"
        assert len(done.output_text.split()) == 40
        rest = list(other.responses.retrieve(made.id, stream=True, starting_after=30))
        assert [e.sequence_number for e in rest] == list(range(31, rest[-1].sequence_number + 1))
        assert rest[-1].type == "response.completed"
        assert rest[-1].response.id == made.id
        assert sdk(one).responses.retrieve(made.id).output_text == done.output_text


def test_a_job_whose_owner_died_ends_failed(redis_server: RedisServer, tmp_path: Path) -> None:
    slow = "{type: simulated, ttft_ms: 20, tpot_ms: 200, tokens: 500}"
    text = config(slow, f'redis: {{url: "{redis_server.url}"}}\nbackground: {{lease_s: 1}}')
    with gateway_process(text, tmp_path) as owner, gateway_process(text, tmp_path) as survivor:
        made = sdk(owner).responses.create(model="m", input="doomed", background=True)
        client = sdk(survivor)
        until(lambda: client.responses.retrieve(made.id).status == "in_progress" or None, what="in_progress")
        assert owner.process is not None
        owner.process.send_signal(signal.SIGKILL)
        owner.process.wait(10)
        killed = time.monotonic()
        failed = finished(client, made.id, timeout=10.0)
        assert failed.status == "failed"
        assert failed.error is not None
        assert failed.error.code == "owner_lost"
        assert time.monotonic() - killed < 8.0  # the lease is 1 s; polls notice it soon after


def test_a_graceful_shutdown_fails_the_owners_jobs_at_once(redis_server: RedisServer, tmp_path: Path) -> None:
    slow = "{type: simulated, ttft_ms: 20, tpot_ms: 200, tokens: 500}"
    text = config(slow, f'redis: {{url: "{redis_server.url}"}}')  # the default lease (10 s) is not waited for
    with gateway_process(text, tmp_path) as owner, gateway_process(text, tmp_path) as survivor:
        made = sdk(owner).responses.create(model="m", input="interrupted", background=True)
        client = sdk(survivor)
        until(lambda: client.responses.retrieve(made.id).status == "in_progress" or None, what="in_progress")
        assert owner.process is not None
        owner.process.terminate()
        owner.process.wait(10)
        ended = client.responses.retrieve(made.id)
        assert ended.status == "failed"
        assert ended.error is not None
        assert ended.error.code == "gateway_shutdown"  # type: ignore[comparison-overlap]  # ours, not in the SDK's Literal
        events = list(client.responses.retrieve(made.id, stream=True))
        assert events[-1].type == "response.failed"
        assert events[-1].response.status == "failed"


def test_background_needs_store(sim: RunningGateway) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(sim).responses.create(model="m", input="x", background=True, store=False)
    assert caught.value.param == "store"


def test_redis_down_refuses_background_requests_and_nothing_else(redis_server: RedisServer) -> None:
    with gateway_thread(config(SLOW_SIM, f'redis: {{url: "{redis_server.url}"}}')) as gw:
        client = sdk(gw)
        made = client.responses.create(model="m", input="before", background=True)
        redis_server.stop()
        with pytest.raises(openai.InternalServerError) as caught:
            client.responses.create(model="m", input="during", background=True)
        assert caught.value.status_code == 503
        assert caught.value.code == "background_unavailable"
        with pytest.raises(openai.InternalServerError):
            client.responses.retrieve(made.id)  # its record is in Redis: unavailable, not lost or wrong
        direct = client.responses.create(model="m", input="not in the background")
        assert direct.status == "completed"
        assert client.responses.retrieve(direct.id).id == direct.id
