"""A real llama-server's life under the gateway: warm-up before ready, its loading window, a restart.

llama-server listens ~50 ms after it is spawned and answers 503 "Loading model" until the model is loaded. With
`-lm none` (no mmap: the file is read into memory) that window lasts seconds, long enough to be seen: the
gateway watches it through `/health`, serves the model's fallback meanwhile (a simulated backend here), and the
model itself once it is up, warmed first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.support.gateway import RunningGateway, gateway_process
from tests.support.llamacpp import Start, wait_for
from tools.llamacpp_server import LlamaServer

MESSAGES: Any = [{"role": "user", "content": "Say something about water gates."}]
SLOW_LOAD = ("-lm", "none")  # read the file instead of mapping it: a loading phase of seconds


def config(llama: LlamaServer, warmup: str = "{requests: 2, max_tokens: 1, timeout_s: 60}") -> str:
    return f"""
backends:
  llama: {{type: llamacpp, base_url: "{llama.base_url}"}}
  standby: {{type: simulated, ttft_ms: 5, tpot_ms: 1, tokens: 3}}
pool: {{warm_connections: 1}}
models:
  tiny: {{backend: llama, fallback: [spare], warmup: {warmup}}}
  spare: {{backend: standby}}
"""


def sdk(gw: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0)


def ask(gw: RunningGateway, stream: bool = False) -> tuple[str, str | None]:
    """(the model that served, the fallback reason) for one chat request, which must succeed."""
    client = sdk(gw)
    if stream:
        with client.chat.completions.with_streaming_response.create(
            model="tiny", messages=MESSAGES, max_tokens=3, stream=True
        ) as response:
            text = "".join(response.iter_lines())
            assert "[DONE]" in text
            return response.headers["x-sluice-model"], response.headers.get("x-sluice-fallback")
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert raw.parse().choices[0].message.content
    return raw.headers["x-sluice-model"], raw.headers.get("x-sluice-fallback")


def state(gw: RunningGateway) -> str:
    backends: dict[str, Any] = httpx.get(f"{gw.url}/status").json()["backends"]
    found: str = backends["llama"]["state"]
    return found


def served_by_llama(gw: RunningGateway) -> Callable[[], bool]:
    return lambda: ask(gw)[0] == "tiny"


def test_warm_up_reaches_the_real_server_before_the_gateway_is_ready(llama_servers: Start, tmp_path: Path) -> None:
    (llama,) = llama_servers(1)
    assert llama.metrics()["tokens_predicted_total"] == 0
    with gateway_process(config(llama, "{requests: 3, max_tokens: 1}"), tmp_path) as gw:
        # Read before any user request: three one-token requests, and a prompt evaluated for them.
        found = llama.metrics()
        assert found["tokens_predicted_total"] == 3
        assert found["prompt_tokens_total"] > 0
        assert state(gw) == "up"
        assert ask(gw) == ("tiny", None)


def test_the_loading_window_is_served_by_the_fallback_then_by_the_model(llama_servers: Start, tmp_path: Path) -> None:
    (llama,) = llama_servers(1, ready=False, extra=SLOW_LOAD)
    with gateway_process(config(llama), tmp_path) as gw:
        # Ready before the server is (readiness is the gateway's own), but the backend is not lost: it is loading.
        wait_for(lambda: state(gw) == "loading", what="the gateway sees the server loading")
        if llama.health() == 503:
            body = httpx.get(f"{llama.url}/health").json()
            assert body["error"]["message"] == "Loading model"
        loading_answers = [ask(gw), ask(gw, stream=True)]
        # The backend was seen loading, so no user request was sent to it: both went to the fallback.
        assert loading_answers == [("spare", "loading"), ("spare", "loading")]
        wait_for(served_by_llama(gw), timeout=90, what="served by the model once loaded")
        assert llama.health() == 200
        assert state(gw) == "up"
        # Warmed on its way up (two one-token requests), before the request that it served.
        assert llama.metrics()["tokens_predicted_total"] >= 2 + 3


def test_a_server_restarted_under_the_gateway(llama_servers: Start, tmp_path: Path) -> None:
    (llama,) = llama_servers(1, extra=SLOW_LOAD)
    with gateway_process(config(llama), tmp_path) as gw:
        assert ask(gw) == ("tiny", None)
        llama.stop()
        gone = ask(gw)  # refused connections: the gateway has not polled yet, the fallback serves
        llama.start()
        # Each answer with the server's /health just before and just after it.
        answers: list[tuple[int | None, tuple[str, str | None], int | None]] = []
        deadline = time.monotonic() + 90
        while not answers or answers[-1][1][0] != "tiny":
            assert time.monotonic() < deadline, f"not served by the restarted model within 90 s: {answers}"
            before = llama.health()
            answers.append((before, ask(gw, stream=len(answers) % 2 == 1), llama.health()))
        assert gone[0] == "spare"
        assert gone[1] is not None
        loading = [answer for before, answer, after in answers if before == 503 and after == 503]
        assert loading, f"no request made while the server was loading: {answers}"
        assert all(answer[0] == "spare" for answer in loading), answers
        assert llama.starts == 2
        assert state(gw) == "up"
        # Its counters started again from zero: since then, the warm-up and the last request.
        assert llama.metrics()["tokens_predicted_total"] >= 2 + 3
