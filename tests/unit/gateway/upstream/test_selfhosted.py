"""Self-hosted backends (vllm, tgi, llamacpp, ollama): what their health path says, what the backend's state
becomes and who is told, and the one-choice servers' refusal of n > 1; no server started."""

from __future__ import annotations

import httpx
import orjson
import pytest

from gateway import errors
from gateway.config import parse
from gateway.context import Exchange
from gateway.upstream.attempts import Upstreams
from gateway.upstream.providers.selfhosted import SelfHostedProvider

CONFIG = """
backends:
  vllm: {type: vllm, base_url: "http://127.0.0.1:9/v1"}
  tgi: {type: tgi, base_url: "http://127.0.0.1:9/v1"}
  llama: {type: llamacpp, endpoints: ["http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1"]}
  ollama: {type: ollama, base_url: "http://127.0.0.1:11434/v1"}
models:
  v: {backend: vllm}
  t: {backend: tgi}
  l: {backend: llama}
  o: {backend: ollama}
"""


@pytest.fixture()
def upstreams() -> Upstreams:
    return Upstreams(parse(CONFIG))


def selfhosted(upstreams: Upstreams, name: str) -> SelfHostedProvider:
    provider = upstreams.http[name]
    assert isinstance(provider, SelfHostedProvider)
    return provider


def chat(**fields: object) -> Exchange:
    body = {"model": "t", "messages": [{"role": "user", "content": "hi"}], **fields}
    return Exchange("r", "chat/completions", [], orjson.dumps(body), body, 0.0)


def test_each_endpoints_server_root_is_asked(upstreams: Upstreams) -> None:
    assert selfhosted(upstreams, "llama").roots == ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    assert selfhosted(upstreams, "vllm").roots == ["http://127.0.0.1:9"]


@pytest.mark.parametrize("name", ["tgi", "ollama"])
def test_one_choice_servers_refuse_n_above_one(upstreams: Upstreams, name: str) -> None:
    provider = selfhosted(upstreams, name)
    target = upstreams.targets[name[0]]
    with pytest.raises(errors.BadRequestError) as refused:
        provider.body(chat(n=2), target)
    assert refused.value.param == "n"
    assert provider.body(chat(n=1), target)


def test_servers_that_answer_several_choices_pass_n_on(upstreams: Upstreams) -> None:
    provider = selfhosted(upstreams, "llama")
    assert orjson.loads(provider.body(chat(n=3), upstreams.targets["l"]))["n"] == 3
    assert provider.usage_of_first_choice


def answering(status: int, body: bytes = b"") -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(lambda _: httpx.Response(status, content=body)))


async def test_the_health_path_says_up_loading_or_up_without_it(upstreams: Upstreams) -> None:
    provider = selfhosted(upstreams, "llama")
    loading = orjson.dumps({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})
    async with answering(503, loading) as http:
        server, detail = await provider.probe(http, "http://127.0.0.1:9")
    assert server == "loading"
    assert "Loading model" in detail
    async with answering(200) as http:
        assert await provider.probe(http, "http://127.0.0.1:9") == ("up", "")
    async with answering(404) as http:
        assert await provider.probe(http, "http://127.0.0.1:9") == ("up", "/health answered 404")


def test_a_change_of_state_is_reported_and_told_to_the_listeners(upstreams: Upstreams) -> None:
    provider = selfhosted(upstreams, "vllm")
    told: list[tuple[str, str]] = []
    provider.listeners.append(lambda p, before, after: told.append((before, after)))
    provider._set("loading", "Loading model")
    assert provider.state == "loading"
    assert provider.report()["server_detail"] == "Loading model"
    provider._set("loading", "Loading model")  # no change: nobody told again
    provider._set("down", "refused")
    assert told == [("unknown", "loading"), ("loading", "down")]
    assert provider.report()["state"] == provider.health.state
