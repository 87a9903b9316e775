"""TGI, llama.cpp and Ollama backends end to end: stand-ins of each on loopback, the gateway, the openai SDK.

Loading, routing around a loading backend, warm-up before ready and again on the way back, keep-warm against
an idle unload: every wait is a poll with a deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

from tests.support.gateway import RunningGateway, gateway_thread
from tests.support.standins import LlamaCppStandIn, OllamaStandIn, TGIStandIn
from tests.support.upstream import Ok, Recorded, ScriptedUpstream, Stall

MESSAGES = [{"role": "user", "content": "hello"}]
STANDINS: dict[str, Callable[[], ScriptedUpstream]] = {
    "tgi": lambda: TGIStandIn(default=Ok(ttft_ms=5, tokens=4)),
    "llamacpp": lambda: LlamaCppStandIn(default=Ok(ttft_ms=5, tokens=4)),
    "ollama": lambda: OllamaStandIn(load_ms=0, default=Ok(ttft_ms=5, tokens=4)),
}


def client(gw: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0)


def wait_for(condition: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.05)


def chat_calls(up: ScriptedUpstream) -> list[Recorded]:
    return [r for r in up.requests if r.path.endswith("/chat/completions")]


def warmups(up: ScriptedUpstream) -> list[Recorded]:
    return [r for r in chat_calls(up) if r.headers.get("x-request-id", "").startswith("warmup-")]


@contextmanager
def backend(kind: str, extra: str = "") -> Iterator[tuple[ScriptedUpstream, RunningGateway]]:
    with STANDINS[kind]() as up:
        config = f"""
backends:
  local: {{type: {kind}, base_url: "{up.url}/v1"}}
pool: {{warm_connections: 1}}
models:
  chat: {{backend: local, upstream_model: "local:latest" {extra}}}
"""
        with gateway_thread(config) as gw:
            yield up, gw


@pytest.mark.parametrize("kind", ["tgi", "llamacpp", "ollama"])
def test_each_backend_type_streamed_and_not(kind: str) -> None:
    with backend(kind) as (up, gw):
        raw = client(gw).chat.completions.with_raw_response.create(model="chat", messages=MESSAGES)
        answer = raw.parse()
        assert answer.choices[0].message.content == "tok0 tok1 tok2 tok3"
        assert raw.headers["x-sluice-model"] == "chat"
        stream = client(gw).chat.completions.create(
            model="chat", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "tok0 tok1 tok2 tok3"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
        sent = chat_calls(up)[-1]
        assert sent.path == "/v1/chat/completions" and sent.json["model"] == "local:latest"
        # One choice per request on all three: a clear 400 before anything is sent, not one choice or a 500.
        before = len(chat_calls(up))
        with pytest.raises(openai.BadRequestError) as refused:
            client(gw).chat.completions.create(model="chat", messages=MESSAGES, n=2)
        assert refused.value.param == "n" and kind in refused.value.message
        assert len(chat_calls(up)) == before
        # n=1 is what every server supports: passed through.
        client(gw).chat.completions.create(model="chat", messages=MESSAGES, n=1)


def test_llamacpp_completions_and_embeddings() -> None:
    with backend("llamacpp") as (up, gw):
        text = client(gw).completions.create(model="chat", prompt="hello", max_tokens=4)
        assert text.choices[0].text == "tok0 tok1 tok2 tok3"
        vectors = client(gw).embeddings.create(model="chat", input=["a", "b"])
        assert len(vectors.data) == 2
        assert {r.path for r in up.requests if r.method == "POST"} >= {"/v1/completions", "/v1/embeddings"}


def test_backend_states_are_watched_with_their_own_health_paths() -> None:
    with backend("tgi") as (tgi, _gw):
        wait_for(lambda: any(r.path == "/info" for r in tgi.requests), what="TGI /info read")
        assert any(r.path == "/health" for r in tgi.requests)
    with backend("ollama") as (ollama, _gw):
        paths = {r.path for r in ollama.requests}
        assert {"/api/version", "/api/ps"} <= paths


def metric(gw: RunningGateway, name: str) -> str:
    return "\n".join(line for line in httpx.get(f"{gw.url}/metrics").text.splitlines() if line.startswith(name))


def test_a_loading_llamacpp_is_routed_around_then_serves_once_loaded() -> None:
    with (
        LlamaCppStandIn(load_s=2.0, default=Ok(ttft_ms=5, tokens=3, text="from llama")) as llama,
        ScriptedUpstream(default=Ok(ttft_ms=5, tokens=3, text="from fallback")) as remote,
    ):
        config = f"""
backends:
  llama: {{type: llamacpp, base_url: "{llama.url}/v1"}}
  remote: {{type: openai, base_url: "{remote.url}/v1"}}
pool: {{warm_connections: 1}}
models:
  local:
    backend: llama
    fallback: [cloud]
    warmup: {{requests: 2, max_tokens: 1, timeout_s: 5}}
  cloud: {{backend: remote}}
"""
        with gateway_thread(config) as gw:  # ready although llama is still loading
            assert llama.loaded is False
            ready = httpx.get(f"{gw.url}/readyz")
            assert ready.status_code == 200 and ready.json()["loading"] == ["llama"]
            assert metric(gw, "sluice_backend_loading") == 'sluice_backend_loading{backend="llama"} 1.0'
            # The warm-up was attempted before ready: refused while loading (503 Loading model).
            attempted = len(warmups(llama))
            assert attempted == 1  # the first was refused, so the second was not sent

            raw = client(gw).chat.completions.with_raw_response.create(model="local", messages=MESSAGES)
            assert raw.parse().choices[0].message.content == "from fallback"
            assert raw.headers["x-sluice-model"] == "cloud" and raw.headers["x-sluice-fallback"] == "loading"
            stream = client(gw).chat.completions.create(model="local", messages=MESSAGES, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "from fallback"
            assert len(chat_calls(llama)) == attempted  # no user request went to the loading server

            def served_by_llama() -> bool:
                raw = client(gw).chat.completions.with_raw_response.create(model="local", messages=MESSAGES)
                return raw.headers["x-sluice-model"] == "local"

            wait_for(served_by_llama, timeout=15, what="served by llama once loaded")
            assert httpx.get(f"{gw.url}/readyz").json() == {"status": "ready"}
            assert metric(gw, "sluice_backend_loading") == 'sluice_backend_loading{backend="llama"} 0.0'
            # Back from loading: warmed again, and this time it worked.
            wait_for(lambda: len(warmups(llama)) >= attempted + 2, what="warm-up after loading")


def test_warmup_requests_reach_the_server_before_the_gateway_is_ready() -> None:
    with backend("tgi", ', warmup: {requests: 3, prompt: "Say ok.", max_tokens: 1}') as (tgi, _gw):
        sent = warmups(tgi)
        assert len(sent) == 3  # counted at the stand-in before the first user request could be made
        assert all(r.json["max_tokens"] == 1 and r.json["model"] == "local:latest" for r in sent)
        assert sent[0].json["messages"] == [{"role": "user", "content": "Say ok."}]


def ollama_gateway(ollama: OllamaStandIn, keep: str) -> str:
    return f"""
backends:
  ol: {{type: ollama, base_url: "{ollama.url}/v1"}}
pool: {{warm_connections: 1}}
models:
  chat: {{backend: ol, upstream_model: "local:latest", warmup: {{requests: 1, timeout_s: 10}} {keep}}}
"""


def timed_chat(gw: RunningGateway) -> float:
    started = time.monotonic()
    client(gw).chat.completions.create(model="chat", messages=MESSAGES)
    return time.monotonic() - started


def test_ollama_idle_unload_costs_a_cold_load_without_keep_warm() -> None:
    with (
        OllamaStandIn(load_ms=1000, idle_s=3, default=Ok(ttft_ms=5, tokens=2)) as ollama,
        gateway_thread(ollama_gateway(ollama, "")) as gw,
    ):
        assert len(ollama.cold) == 1  # the warm-up paid the first load, before ready
        timed_chat(gw)
        assert len(ollama.cold) == 1
        wait_for(lambda: not ollama.resident(), timeout=10, what="idle unload")
        assert timed_chat(gw) >= 0.9  # the next request waits for the load
        assert len(ollama.cold) == 2


def test_ollama_keep_warm_keeps_the_model_resident() -> None:
    with (
        OllamaStandIn(load_ms=1000, idle_s=3, default=Ok(ttft_ms=5, tokens=2)) as ollama,
        gateway_thread(ollama_gateway(ollama, ', keep_warm_s: 1, keep_alive: "3s"')) as gw,
    ):
        assert ollama.loads == 1 and not ollama.cold  # the warm-up loaded it (natively, with the keep_alive)
        timed_chat(gw)
        last = time.monotonic()
        # Longer than the idle timeout without a user request: only the keep-warm pings reach the server.
        wait_for(lambda: sum(p > last for p in ollama.pings) >= 4, timeout=15, what="keep-warm pings")
        assert time.monotonic() - last > 3
        assert timed_chat(gw) < 0.9
        assert not ollama.cold and ollama.loads == 1  # no user request paid the load
        body = [r.json for r in ollama.requests if r.path == "/api/generate"][-1]
        assert body == {"model": "local:latest", "keep_alive": "3s"}


def test_a_warmup_that_hangs_is_bounded_by_its_timeout() -> None:
    with ScriptedUpstream(default=Ok(ttft_ms=5, tokens=2)) as up:
        up.script(Stall())
        config = f"""
backends:
  up: {{type: openai, base_url: "{up.url}/v1"}}
pool: {{warm_connections: 1}}
models:
  chat: {{backend: up, warmup: {{requests: 3, timeout_s: 1}}}}
"""
        started = time.monotonic()
        with gateway_thread(config) as gw:
            waited = time.monotonic() - started
            assert 1.0 <= waited < 8.0  # ready after the attempt, not after its success
            assert len(chat_calls(up)) == 1  # the hung first one; the others were not sent
            assert up.wait_disconnect(2.0)  # and it was abandoned, not left open
            assert client(gw).chat.completions.create(model="chat", messages=MESSAGES).choices
