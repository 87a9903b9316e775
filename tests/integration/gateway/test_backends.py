"""TGI, llama.cpp and Ollama backends end to end: stand-ins of each on loopback, the gateway, the openai SDK.

Loading, routing around a loading backend, warm-up before ready and again on the way back, keep-warm against
an idle unload: every wait is a poll with a deadline.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateway import RunningGateway, free_port, gateway_thread
from tests.support.standins import Standins, standin
from tests.support.upstream import Ok, Recorded, ScriptedUpstream, Stall

MESSAGES: Any = [{"role": "user", "content": "hello"}]


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


def requests(server: Standins, path: str) -> int:
    """How many requests for `path` reached the stand-in."""
    count: int = server.stats()["requests"].get(path, 0)
    return count


@contextmanager
def backend(kind: str, extra: str = "", **options: Any) -> Iterator[tuple[Standins, RunningGateway]]:
    with standin(kind, tokens=4, **options) as server:
        config = f"""
backends:
  local: {{type: {kind}, base_url: "{server.base_url()}"}}
pool: {{warm_connections: 1}}
models:
  chat: {{backend: local, upstream_model: sim {extra}}}
"""
        with gateway_thread(config) as gw:
            yield server, gw


@pytest.mark.parametrize("kind", ["tgi", "llamacpp", "ollama"])
def test_each_backend_type_streamed_and_not(kind: str) -> None:
    with backend(kind) as (server, gw):
        raw = client(gw).chat.completions.with_raw_response.create(model="chat", messages=MESSAGES)
        whole = raw.parse().choices[0].message.content
        assert whole
        assert len(whole.split()) == 4
        assert raw.headers["x-sluice-model"] == "chat"
        stream = client(gw).chat.completions.create(
            model="chat", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 4
        assert requests(server, "/v1/chat/completions") == 2
        if kind == "llamacpp":
            # n up to its slots: the server decides (test_engine_usage.py has the rest).
            several = client(gw).chat.completions.create(model="chat", messages=MESSAGES, n=2)
            assert len(several.choices) == 2
        else:
            # One choice per request: a clear 400 before anything is sent, not one choice or a 500.
            with pytest.raises(openai.BadRequestError) as refused:
                client(gw).chat.completions.create(model="chat", messages=MESSAGES, n=2)
            assert refused.value.param == "n"
            assert kind in refused.value.message
        sent = 3 if kind == "llamacpp" else 2
        assert requests(server, "/v1/chat/completions") == sent
        # n=1 is what every server supports: passed through.
        client(gw).chat.completions.create(model="chat", messages=MESSAGES, n=1)
        assert requests(server, "/v1/chat/completions") == sent + 1


@pytest.mark.parametrize("kind", ["tgi", "llamacpp"])
def test_completions_through_tgi_and_llamacpp(kind: str) -> None:
    with backend(kind) as (server, gw):
        text = client(gw).completions.create(model="chat", prompt="hello there", max_tokens=4)
        assert len(text.choices[0].text.split()) == 4
        assert requests(server, "/v1/completions") == 1


def test_backend_states_are_watched_with_their_own_health_paths() -> None:
    with backend("tgi") as (tgi, gw):
        wait_for(lambda: requests(tgi, "/info") >= 1, what="TGI /info read")
        assert requests(tgi, "/health") >= 1
        wait_for(lambda: "info" in httpx.get(f"{gw.url}/status").json()["backends"]["local"], what="info shown")
        shown = httpx.get(f"{gw.url}/status").json()["backends"]["local"]
        assert shown["state"] == "up"
        assert shown["server"] == "up"
        assert shown["info"]["max_total_tokens"] > 0
    with backend("ollama") as (ollama, gw):
        assert requests(ollama, "/api/version") >= 1
        assert requests(ollama, "/api/ps") >= 1
        shown = httpx.get(f"{gw.url}/status").json()["backends"]["local"]
        assert shown["server"] == "up"
        assert isinstance(shown["resident"], list)


def metric(gw: RunningGateway, name: str) -> str:
    return "\n".join(line for line in httpx.get(f"{gw.url}/metrics").text.splitlines() if line.startswith(name))


def test_a_loading_llamacpp_is_routed_around_then_serves_once_loaded() -> None:
    with (
        standin("llamacpp", load_ms=2000, tokens=3) as llama,
        ScriptedUpstream(default=Ok(ttft_ms=5, tokens=3, text="from fallback")) as remote,
    ):
        config = f"""
backends:
  llama: {{type: llamacpp, base_url: "{llama.base_url()}"}}
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
            assert llama.stats()["loads"] == 0
            ready = httpx.get(f"{gw.url}/readyz")
            assert ready.status_code == 200
            assert ready.json()["backends"]["llama"]["state"] == "loading"
            assert metric(gw, "sluice_backend_loading") == 'sluice_backend_loading{backend="llama"} 1.0'
            # The warm-up was attempted before ready: refused while loading (503 Loading model), so the
            # second of its two requests was not sent.
            assert requests(llama, "/v1/chat/completions") == 1

            raw = client(gw).chat.completions.with_raw_response.create(model="local", messages=MESSAGES)
            assert raw.parse().choices[0].message.content == "from fallback"
            assert raw.headers["x-sluice-model"] == "cloud"
            assert raw.headers["x-sluice-fallback"] == "loading"
            stream = client(gw).chat.completions.create(model="local", messages=MESSAGES, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "from fallback"
            assert requests(llama, "/v1/chat/completions") == 1  # no user request went to the loading server

            def served_by_llama() -> bool:
                raw = client(gw).chat.completions.with_raw_response.create(model="local", messages=MESSAGES)
                return raw.headers["x-sluice-model"] == "local"

            wait_for(served_by_llama, timeout=15, what="served by llama once loaded")
            assert httpx.get(f"{gw.url}/readyz").json()["backends"]["llama"]["state"] == "up"
            assert metric(gw, "sluice_backend_loading") == 'sluice_backend_loading{backend="llama"} 0.0'
            # Back from loading: warmed again (two one-token requests), and this time it worked.
            wait_for(lambda: llama.stats()["warmups"] >= 2, what="warm-up after loading")


def test_warmup_requests_reach_the_server_before_the_gateway_is_ready() -> None:
    with backend("tgi", ', warmup: {requests: 3, prompt: "Say ok.", max_tokens: 1}') as (tgi, _gw):
        stats = tgi.stats()  # read before the first user request could be made
        assert stats["warmups"] == 3
        assert stats["requests"]["/v1/chat/completions"] == 3


def ollama_gateway(ollama: Standins, keep: str) -> str:
    return f"""
backends:
  ol: {{type: ollama, base_url: "{ollama.base_url()}"}}
pool: {{warm_connections: 1}}
models:
  chat: {{backend: ol, upstream_model: sim, warmup: {{requests: 1, timeout_s: 10}} {keep}}}
"""


def timed_chat(gw: RunningGateway) -> float:
    started = time.monotonic()
    client(gw).chat.completions.create(model="chat", messages=MESSAGES)
    return time.monotonic() - started


def test_ollama_idle_unload_costs_a_cold_load_without_keep_warm() -> None:
    with (
        standin("ollama", load_ms=1000, idle_unload_s=3, tokens=2) as ollama,
        gateway_thread(ollama_gateway(ollama, "")) as gw,
    ):
        assert ollama.stats()["loads"] == 1  # the warm-up paid the first load, before ready
        timed_chat(gw)
        assert ollama.stats()["loads"] == 1
        wait_for(lambda: ollama.stats()["unloads"] >= 1, timeout=10, what="idle unload")
        assert timed_chat(gw) >= 0.9  # the next request waits for the load
        assert ollama.stats()["loads"] == 2


def test_ollama_keep_warm_keeps_the_model_resident() -> None:
    with (
        standin("ollama", load_ms=1000, idle_unload_s=3, tokens=2) as ollama,
        gateway_thread(ollama_gateway(ollama, ', keep_warm_s: 1, keep_alive: "3s"')) as gw,
    ):
        assert ollama.stats()["loads"] == 1  # the warm-up loaded it (natively, with the keep_alive)
        assert timed_chat(gw) < 0.9
        last = time.monotonic()
        pinged = requests(ollama, "/api/generate")
        # Longer than the idle timeout without a user request: only the keep-warm loads reach the server.
        wait_for(lambda: requests(ollama, "/api/generate") >= pinged + 4, timeout=15, what="keep-warm pings")
        assert time.monotonic() - last > 3
        assert timed_chat(gw) < 0.9  # no user request paid the load
        stats = ollama.stats()
        assert stats["loads"] == 1
        assert stats["unloads"] == 0
        resident = httpx.get(f"{ollama.url}/api/ps").json()["models"]
        assert [m["name"] for m in resident] == ["sim:latest"]


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


def test_a_backend_that_was_down_is_warmed_again_when_it_comes_back() -> None:
    port = free_port()
    config = f"""
backends:
  up: {{type: openai, base_url: "http://127.0.0.1:{port}/v1", timeouts: {{connect_s: 1}}}}
pool: {{warm_connections: 1}}
models:
  chat: {{backend: up, upstream_model: sim, warmup: {{requests: 2, timeout_s: 5}}}}
"""
    with gateway_thread(config) as gw:  # ready: the warm-up was attempted (and failed: nothing listens)
        assert httpx.get(f"{gw.url}/status").json()["backends"]["up"]["state"] == "down"
        server = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "sim", "--like", "vllm", "--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:

            def warmups() -> int:
                try:
                    count: int = httpx.get(f"http://127.0.0.1:{port}/_sim/stats").json()["warmups"]
                except httpx.TransportError:
                    return 0
                return count

            wait_for(lambda: warmups() >= 2, timeout=40, what="warm-up after the backend came back")
            assert httpx.get(f"{gw.url}/status").json()["backends"]["up"]["state"] == "up"
        finally:
            server.terminate()
            server.wait(10)


def test_a_backend_with_several_endpoints_is_loading_only_while_none_is_up() -> None:
    with standin("llamacpp", load_ms=60_000) as slow, standin("llamacpp", load_ms=0) as ready:
        config = f"""
backends:
  both: {{type: llamacpp, endpoints: ["{slow.base_url()}", "{ready.base_url()}"]}}
  slow: {{type: llamacpp, base_url: "{slow.base_url()}"}}
pool: {{warm_connections: 1}}
models:
  a: {{backend: both}}
  b: {{backend: slow}}
"""
        with gateway_thread(config) as gw:
            backends = httpx.get(f"{gw.url}/status").json()["backends"]
            assert backends["both"]["state"] != "loading"
            assert backends["both"]["server"] == "up"
            assert backends["slow"]["state"] == "loading"
            assert backends["slow"]["server_detail"] == "Loading model"
            assert requests(slow, "/health") >= 2
            assert requests(ready, "/health") >= 1
