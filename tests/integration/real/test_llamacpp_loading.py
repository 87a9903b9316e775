"""A real llama-server's life under the gateway: warm-up before ready, its loading window, a restart.

llama-server listens ~50 ms after it is spawned and answers 503 "Loading model" until the model is loaded. With
`-lm none` (no mmap: the file is read into memory) that window lasts seconds, long enough to be seen: the
gateway watches it through `/health`, serves the model's fallback meanwhile (a simulated backend here), and the
model itself once it is up, warmed first.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.support.gateway import RunningGateway, gateway_process
from tests.support.llamacpp import Start, wait_for
from tools.llamacpp.server import LlamaServer

MESSAGES: Any = [{"role": "user", "content": "Say something about water gates."}]
SLOW_LOAD = ("-lm", "none")  # read the file instead of mapping it: a loading phase of seconds
# (the server's /health before, the answer, its /health after)
Answer = tuple[int | None, tuple[str, str | None], int | None]


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


def ask(client: openai.OpenAI, stream: bool = False) -> tuple[str, str | None]:
    """(the model that served, the fallback reason) for one chat request, which must succeed."""
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


def test_warm_up_reaches_the_real_server_before_the_gateway_is_ready(llama_servers: Start, tmp_path: Path) -> None:
    (llama,) = llama_servers(1)
    assert llama.metrics()["tokens_predicted_total"] == 0
    with gateway_process(config(llama, "{requests: 3, max_tokens: 1}"), tmp_path) as gw:
        # Read before any user request: three one-token requests, and a prompt evaluated for them.
        found = llama.metrics()
        assert found["tokens_predicted_total"] == 3
        assert found["prompt_tokens_total"] > 0
        assert state(gw) == "up"
        assert ask(sdk(gw)) == ("tiny", None)


def through_the_start(gw: RunningGateway, llama: LlamaServer) -> list[Answer]:
    """Start `llama` and ask the gateway again and again until the model serves; each answer between the
    server's /health just before and just after it (and every other one streamed)."""
    client = sdk(gw)
    llama.start()
    answers: list[Answer] = []
    deadline = time.monotonic() + 90
    while not answers or answers[-1][1][0] != "tiny":
        assert time.monotonic() < deadline, f"not served by the model within 90 s: {answers}"
        before = llama.health()
        answers.append((before, ask(client, stream=len(answers) % 2 == 1), llama.health()))
    return answers


def loading(answers: list[Answer]) -> list[tuple[str, str | None]]:
    """The answers to requests made while the server said 503 "Loading model" both before and after."""
    return [answer for before, answer, after in answers if before == 503 and after == 503]


def through_a_loading_window(gw: RunningGateway, llama: LlamaServer, starts: int = 5) -> list[Answer]:
    """`through_the_start`, started again until a request fell wholly inside the loading window.

    The window lasts ~0.2-1.3 s (the file read, the warm-up run) and a loaded machine can stretch one request over
    all of it; a start whose window no request fell into says nothing, so the server is stopped and started again.
    """
    tried: list[list[Answer]] = []
    while len(tried) < starts:
        answers = through_the_start(gw, llama)
        if loading(answers):
            return answers
        tried.append(answers)
        llama.stop()
        wait_for(lambda: ask(sdk(gw))[0] == "spare", what="the fallback serves again")
    raise AssertionError(f"no request fell inside the loading window in {starts} starts: {tried}")


def test_the_loading_window_is_served_by_the_fallback_then_by_the_model(llama_servers: Start, tmp_path: Path) -> None:
    (llama,) = llama_servers(1, ready=False, start=False, extra=SLOW_LOAD)
    with gateway_process(config(llama), tmp_path) as gw:
        assert ask(sdk(gw))[0] == "spare"  # not started yet
        answers = through_a_loading_window(gw, llama)
        # Whether the gateway had seen it loading (and routed around it) or sent a request that got the
        # server's 503 (and tried the next target), the fallback answered.
        assert {model for model, _ in loading(answers)} == {"spare"}, answers
        assert all(reason is not None for model, reason in loading(answers)), answers
        assert llama.health() == 200
        wait_for(lambda: state(gw) == "up", what="the gateway sees the server up")
        # Warmed on its way up (two one-token requests), before or beside the request that it served.
        wait_for(lambda: llama.metrics()["tokens_predicted_total"] >= 2 + 3, what="warm-up and the answer")


def test_a_server_restarted_under_the_gateway(llama_servers: Start, tmp_path: Path) -> None:
    (llama,) = llama_servers(1, extra=SLOW_LOAD)
    with gateway_process(config(llama), tmp_path) as gw:
        assert ask(sdk(gw)) == ("tiny", None)
        assert llama.metrics()["tokens_predicted_total"] == 2 + 3  # the warm-up's and the answer's
        llama.stop()
        gone = ask(sdk(gw))  # refused connections, before the gateway's next poll: the fallback serves
        assert gone[0] == "spare"
        assert gone[1] is not None
        answers = through_a_loading_window(gw, llama)
        assert {model for model, _ in loading(answers)} == {"spare"}, answers
        assert llama.starts >= 2
        assert state(gw) == "up"
        # A new process, its counters from zero: the last answer (and a warm-up, if the gateway's health watch,
        # which polls an up server every 10 s, happened to see the restart).
        assert 3 <= llama.metrics()["tokens_predicted_total"] <= 3 + 2
