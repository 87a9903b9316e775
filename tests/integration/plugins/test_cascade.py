"""The small model first, end to end: the gateway under uvicorn, a simulated small model scripted to answer some
requests badly (`failures:`), a simulated large one; each check seen failing and escalating, the bound, the
asynchronous form through a real background job, and the metric.

Which request the small model spoils, and how, is fixed by a hash of its messages (gateway/simulation/faults.py):
the tests find prompts of each kind with `faults.pick`, as the simulator will.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.simulation import faults
from gateway.simulation.answers import _canonical
from tests.support.gateway import RunningGateway, free_port, gateway_thread
from tests.support.wait import wait_until

MIX = {"empty": 0.15, "length": 0.15, "json": 0.15, "tool_args": 0.15, "logprob": 0.15}


def config(mode: str = "escalate", max_total_ms: int = 5000, large_ttft: int = 30, extra: str = "") -> str:
    mix = ", ".join(f"{k}: {v}" for k, v in MIX.items())
    return f"""
backends:
  small: {{type: simulated, ttft_ms: 5, tpot_ms: 0, tokens: 8, failures: {{{mix}}}}}
  large: {{type: simulated, ttft_ms: {large_ttft}, tpot_ms: 0, tokens: 8}}
models:
  chat:
    backend: large
    upstream_model: big
    cascade: {{small: chat-small, mode: {mode}, max_total_ms: {max_total_ms}, min_mean_logprob: -1.0{extra}}}
  chat-small: {{backend: small, upstream_model: little}}
plugins: [cascade]
"""


def prompt(kind: str | None) -> list[dict[str, str]]:
    """Messages the small model answers as `kind` says (None: well)."""
    mix = tuple(MIX.items())
    for i in range(10_000):
        messages = [{"role": "user", "content": f"question {i}"}]
        if faults.pick(mix, b"fault\0" + _canonical(messages, "messages")) == kind:
            return messages
    raise AssertionError(f"no prompt found for {kind}")


def post(gw: RunningGateway, kind: str | None, **body: Any) -> httpx.Response:
    payload = {"model": "chat", "messages": prompt(kind), "response_format": {"type": "json_object"}, **body}
    return httpx.post(f"{gw.base_url}/chat/completions", json=payload, timeout=30)


@pytest.fixture(scope="module")
def gateway() -> Iterator[RunningGateway]:
    with gateway_thread(config()) as gw:
        yield gw


def test_a_good_small_answer_is_served_as_is(gateway: RunningGateway) -> None:
    response = post(gateway, None)
    assert response.status_code == 200, response.text
    assert response.headers["x-sluice-model"] == "chat-small"
    assert response.headers["x-sluice-cascade"] == "small"
    body = response.json()
    assert body["model"] == "little"
    assert orjson.loads(body["choices"][0]["message"]["content"])  # the JSON asked for
    assert body["choices"][0]["logprobs"] is None  # asked for on the client's behalf, taken out again


@pytest.mark.parametrize("kind", ["empty", "length", "json", "logprob"])
def test_each_failed_check_escalates_to_the_large_model(gateway: RunningGateway, kind: str) -> None:
    response = post(gateway, kind)
    assert response.status_code == 200, response.text
    assert response.headers["x-sluice-model"] == "chat"
    assert response.headers["x-sluice-cascade"] == "escalated"
    assert response.headers["x-sluice-cascade-reason"] == kind
    assert response.json()["model"] == "big"


def test_a_tool_call_that_does_not_parse_escalates(gateway: RunningGateway) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    good = post(gateway, None, tools=tools)
    assert good.headers["x-sluice-cascade"] == "small"
    call = good.json()["choices"][0]["message"]["tool_calls"][0]
    assert orjson.loads(call["function"]["arguments"])
    bad = post(gateway, "tool_args", tools=tools)
    assert bad.headers["x-sluice-cascade"] == "escalated"
    assert bad.headers["x-sluice-cascade-reason"] == "tool_args"


def test_streams_and_other_models_are_not_touched(gateway: RunningGateway) -> None:
    payload = {"model": "chat", "messages": prompt("empty"), "stream": True}
    with httpx.stream("POST", f"{gateway.base_url}/chat/completions", json=payload, timeout=30) as response:
        response.read()
        assert response.headers["x-sluice-model"] == "chat"
        assert "x-sluice-cascade" not in response.headers
    small = httpx.post(f"{gateway.base_url}/chat/completions", json={**payload, "model": "chat-small", "stream": False})
    assert "x-sluice-cascade" not in small.headers


def test_escalations_are_counted(gateway: RunningGateway) -> None:
    post(gateway, "json")
    metrics = httpx.get(f"{gateway.url}/metrics").text
    lines = [line for line in metrics.splitlines() if line.startswith("sluice_cascade_total{")]
    assert any('outcome="escalated"' in line and 'reason="json"' in line for line in lines), lines
    assert any('outcome="small"' in line for line in lines), lines


def test_the_bound_keeps_the_small_answer_when_the_large_is_too_slow() -> None:
    with gateway_thread(config(max_total_ms=300, large_ttft=3000)) as gw:
        began = time.perf_counter()
        response = post(gw, "json")
        elapsed = time.perf_counter() - began
        assert response.status_code == 200, response.text
        assert response.headers["x-sluice-cascade"] == "kept"
        assert response.headers["x-sluice-cascade-reason"] == "json"
        assert response.headers["x-sluice-model"] == "chat-small"
        assert elapsed < 2.5  # the bound (0.3 s), not the large model's 3 s; generous for a busy machine
        began = time.perf_counter()
        empty = post(gw, "empty")
        assert empty.headers["x-sluice-cascade"] == "kept"  # an empty answer is an answer: served, marked
        assert time.perf_counter() - began < 2.5


def test_async_returns_the_small_answer_and_a_job_with_the_large_one() -> None:
    with gateway_thread(config(mode="async")) as gw:
        response = post(gw, "json")
        assert response.status_code == 200, response.text
        assert response.headers["x-sluice-cascade"] == "async"
        assert response.headers["x-sluice-model"] == "chat-small"
        assert response.json()["model"] == "little"
        job = response.headers["x-sluice-cascade-job"]
        assert job.startswith("bgjob_")

        def done() -> dict[str, Any] | None:
            found: dict[str, Any] = httpx.get(f"{gw.base_url}/sluice/background/{job}").json()
            return found if found.get("status") == "completed" else None

        result = wait_until(done, timeout=10)
        assert "big" in orjson.dumps(result).decode()
        good = post(gw, None)
        assert good.headers["x-sluice-cascade"] == "small"
        assert "x-sluice-cascade-job" not in good.headers


def test_a_failed_small_model_escalates_and_the_bound_is_a_504_with_nothing_to_keep() -> None:
    text = f"""
backends:
  gone: {{type: openai, base_url: "http://127.0.0.1:{free_port()}/v1"}}
  large: {{type: simulated, ttft_ms: LARGE, tpot_ms: 0, tokens: 4}}
models:
  chat: {{backend: large, cascade: {{small: chat-small, max_total_ms: 400}}}}
  chat-small: {{backend: gone}}
pool: {{warm_connections: 0}}
plugins: [cascade]
"""
    with gateway_thread(text.replace("LARGE", "20")) as gw:
        response = post(gw, None)
        assert response.status_code == 200, response.text
        assert response.headers["x-sluice-cascade"] == "escalated"
        assert response.headers["x-sluice-cascade-reason"] == "error_502"
        assert response.headers["x-sluice-model"] == "chat"
    with gateway_thread(text.replace("LARGE", "3000")) as gw:
        began = time.perf_counter()
        response = post(gw, None)
        assert response.status_code == 504, response.text
        assert response.json()["error"]["code"] == "cascade_timeout"
        assert time.perf_counter() - began < 2.5


def test_both_models_tokens_count_against_the_rate_limit() -> None:
    text = config(extra="").replace(
        "plugins: [cascade]",
        "tenants:\n  t: {keys: [KEYHASH], rate_limit: {tokens_per_minute: 1000000}}\n"
        "auth: {required: true}\nplugins: [auth, rate_limit, cascade]",
    )
    from plugins.auth.keys import new_key

    key, digest = new_key()
    with gateway_thread(text.replace("KEYHASH", f'"{digest}"')) as gw:
        payload = {"model": "chat", "messages": prompt("json"), "response_format": {"type": "json_object"}}
        headers = {"authorization": f"Bearer {key}"}
        response = httpx.post(f"{gw.base_url}/chat/completions", json=payload, headers=headers, timeout=30)
        assert response.headers["x-sluice-cascade"] == "escalated"
        escalated = response.json()["usage"]["total_tokens"]

        def metered() -> float | None:
            lines = httpx.get(f"{gw.url}/metrics").text.splitlines()
            found = [
                float(line.rsplit(" ", 1)[1])
                for line in lines
                if line.startswith("sluice_tokens_total{") and 'tenant="t"' in line
                and ('direction="input"' in line or 'direction="output"' in line)
            ]  # fmt: skip
            return sum(found) or None

        counted = wait_until(metered, timeout=10, what="the tokens metric")
        assert counted > escalated  # the small model's tokens too
