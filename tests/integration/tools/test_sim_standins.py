"""`sluice sim --like ollama|llamacpp|tgi|vllm`: each stand-in's paths, health, loading and quirks, on loopback."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError, InternalServerError, NotFoundError

from tests.support.standins import Standins, standin

MESSAGES: Any = [{"role": "user", "content": "hello there"}]


def client(server: Standins) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.base_url(), api_key="x", max_retries=0)


@pytest.mark.parametrize("like", ["vllm", "tgi", "llamacpp", "ollama"])
async def test_each_stand_in_answers_the_sdk_streamed_and_not(like: str) -> None:
    with standin(like, tokens=5) as server:
        async with client(server) as sdk:
            whole = await sdk.chat.completions.create(model="sim", messages=MESSAGES)
            stream = await sdk.chat.completions.create(
                model="sim", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
            )
            chunks = [chunk async for chunk in stream]
        assert server.stats()["requests"]["/v1/chat/completions"] == 2
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert len(text.split()) == 5
    assert whole.usage is not None
    assert whole.usage.completion_tokens == 5
    usage = [chunk.usage for chunk in chunks if chunk.usage is not None]
    assert len(usage) == 1
    assert usage[0].completion_tokens == 5
    if like == "tgi":  # 2.3 to 3.1 (the stand-in is 3.0.1 unless told): on the finish chunk
        assert chunks[-1].choices[0].finish_reason == "stop"
    else:
        assert chunks[-1].choices == []


@pytest.mark.parametrize("like", ["vllm", "tgi", "llamacpp"])
async def test_completions_stream_with_usage_and_one_token_requests_count_as_warm_ups(like: str) -> None:
    with standin(like, tokens=3) as server:
        async with client(server) as sdk:
            stream = await sdk.completions.create(
                model="sim", prompt="one two three", stream=True, stream_options={"include_usage": True}
            )
            chunks = [chunk async for chunk in stream]
            await sdk.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=1)
        stats = server.stats()
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices).split() != []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == 3
    assert stats["warmups"] == 1
    assert stats["requests"]["/v1/completions"] == 1


async def test_llamacpp_is_503_while_loading_then_healthy() -> None:
    with standin("llamacpp", load_ms=1500) as server:
        async with httpx.AsyncClient() as http:
            health = await http.get(server.url + "/health")
            assert health.status_code == 503
            assert health.json() == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
            async with client(server) as sdk:
                with pytest.raises(InternalServerError) as refused:
                    await sdk.chat.completions.create(model="sim", messages=MESSAGES)
            assert refused.value.status_code == 503
            assert (await http.get(server.url + "/v1/models")).status_code == 200  # answered while loading
            deadline = time.monotonic() + 15
            while (health := await http.get(server.url + "/health")).status_code == 503:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            assert health.status_code == 200
            assert health.json() == {"status": "ok"}
            props = (await http.get(server.url + "/props")).json()
            assert props["total_slots"] == 8
            assert "n_ctx" in props["default_generation_settings"]
            models = (await http.get(server.url + "/v1/models")).json()
            assert models["data"][0]["owned_by"] == "llamacpp"
        assert server.stats()["loads"] == 1


async def test_llamacpp_takes_n_up_to_its_slots_and_names_its_own_model() -> None:
    with standin("llamacpp", max_batch=2) as server:
        async with client(server) as sdk:
            with pytest.raises(BadRequestError, match=r"Field 'n': Value must be between 1 <= value <= 2, but got 3"):
                await sdk.chat.completions.create(model="sim", messages=MESSAGES, n=3)
            answer = await sdk.chat.completions.create(model="anything", messages=MESSAGES)
            both = await sdk.chat.completions.create(model="sim", messages=MESSAGES, n=2)
            stream = await sdk.chat.completions.create(
                model="sim", messages=MESSAGES, n=2, stream=True, stream_options={"include_usage": True}
            )
            chunks = [chunk async for chunk in stream]
        async with httpx.AsyncClient() as http:
            slots = (await http.get(server.url + "/slots")).json()
    assert answer.model == "sim"
    assert [c.message.content for c in both.choices] == [answer.choices[0].message.content] * 2
    assert both.usage is not None
    assert both.usage.completion_tokens == 6
    # The choices interleave; each ends with its finish chunk and its own usage chunk, which has `timings`.
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    usages = [c for c in chunks if c.usage is not None]
    assert [c.choices for c in usages] == [[], []]
    assert all(c.usage and c.usage.completion_tokens == 6 for c in usages)
    assert all((c.model_extra or {}).get("timings", {}).get("predicted_n") == 6 for c in usages)
    assert [slot["id"] for slot in slots] == [0, 1]
    assert not any(slot["is_processing"] for slot in slots)


async def test_llamacpp_metrics_and_prompt_cache_as_the_server_reports_them() -> None:
    words = " ".join(["word"] * 60)
    long: Any = [{"role": "user", "content": words}]
    with standin("llamacpp") as server:
        async with client(server) as sdk:
            first = await sdk.chat.completions.create(model="sim", messages=long)
            again = await sdk.chat.completions.create(model="sim", messages=long)
        metrics = server.metrics()
    assert first.usage is not None
    assert again.usage is not None
    cached = again.usage.prompt_tokens_details
    assert cached is not None
    prompt = first.usage.prompt_tokens
    # Reused token by token, as a slot's common prefix is; the last token is always computed again.
    assert cached.cached_tokens == prompt - 1
    assert (again.model_extra or {})["timings"]["cache_n"] == cached.cached_tokens
    # Computed tokens exclude the cached ones; the cached ones are a counter of their own.
    assert metrics["llamacpp:prompt_tokens_total"] == 2 * prompt - cached.cached_tokens
    assert metrics["llamacpp:prompt_tokens_cached_total"] == cached.cached_tokens
    assert metrics["llamacpp:tokens_predicted_total"] == 12
    assert "llamacpp:kv_cache_usage_ratio" not in metrics  # gone from current builds


@pytest.mark.parametrize("like", ["tgi", "vllm"])
async def test_tgi_and_vllm_open_their_port_only_once_loaded(like: str) -> None:
    with standin(like, load_ms=800, wait=False) as server:
        start = time.monotonic()
        async with httpx.AsyncClient() as http:
            with pytest.raises(httpx.ConnectError):
                await http.get(server.url + "/health")
            deadline = start + 15
            while True:
                try:
                    health = await http.get(server.url + "/health")
                    break
                except httpx.ConnectError:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)
        assert health.status_code == 200
        assert time.monotonic() - start >= 0.7


async def test_tgi_info_limits_and_its_own_error_shape() -> None:
    with standin("tgi", model="org/tgi-model", max_model_len=300) as server:
        async with httpx.AsyncClient() as http:
            info = (await http.get(server.url + "/info")).json()
            refused = await http.post(
                server.base_url() + "/chat/completions", json={"model": "tgi", "messages": MESSAGES, "max_tokens": 299}
            )
        assert info["model_id"] == "org/tgi-model"
        assert info["max_total_tokens"] == 300
        assert refused.status_code == 422
        assert refused.json()["error_type"] == "validation"
        assert "must be <= 300" in refused.json()["error"]
        async with client(server) as sdk:
            answer = await sdk.chat.completions.create(model="tgi", messages=MESSAGES, n=3)
    assert answer.model == "org/tgi-model"
    assert len(answer.choices) == 1  # model and n are ignored


@pytest.mark.parametrize(("version", "own_chunk"), [("2.3.0", False), ("3.1.1", False), ("3.2.0", True)])
async def test_tgi_streams_usage_in_the_shape_of_its_release(version: str, own_chunk: bool) -> None:
    with standin("tgi", server_version=version) as server:
        async with client(server) as sdk:
            stream = await sdk.chat.completions.create(
                model="tgi", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
            )
            chunks = [chunk async for chunk in stream]
        async with httpx.AsyncClient() as http:
            info = (await http.get(server.url + "/info")).json()
    assert info["version"] == version
    (carrier,) = [c for c in chunks if c.usage is not None]
    assert carrier is chunks[-1]
    assert carrier.usage is not None
    assert carrier.usage.completion_tokens == 6
    if own_chunk:
        assert carrier.choices == []
        assert chunks[-2].choices[0].finish_reason == "stop"
    else:
        assert carrier.choices[0].finish_reason == "stop"


async def test_vllm_refusals_and_its_stream_options_rules() -> None:
    with standin("vllm", max_model_len=50) as server:
        async with client(server) as sdk:
            with pytest.raises(NotFoundError):
                await sdk.chat.completions.create(model="other", messages=MESSAGES)
            with pytest.raises(BadRequestError, match="maximum context length is 50 tokens"):
                await sdk.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=48)
            with pytest.raises(BadRequestError, match="Stream options can only be defined when `stream=True`"):
                await sdk.chat.completions.create(
                    model="sim", messages=MESSAGES, stream_options={"include_usage": True}
                )
            stream = await sdk.chat.completions.create(model="sim", messages=MESSAGES, stream=True, stream_options={})
            assert [chunk async for chunk in stream][-1].usage is not None  # include_usage defaults to true
        async with httpx.AsyncClient() as http:
            refused = await http.post(server.base_url() + "/chat/completions", json={"model": "sim", "messages": []})
            version = (await http.get(server.url + "/version")).json()
        assert refused.status_code == 400
        assert refused.json()["error"]["type"] == "BadRequestError"
        assert version["version"]


async def timed(http: httpx.AsyncClient, server: Standins, path: str, body: dict[str, Any]) -> tuple[float, Any]:
    start = time.monotonic()
    answer = await http.post(server.url + path, json=body)
    assert answer.status_code == 200, answer.text
    return time.monotonic() - start, answer.json()


async def test_ollama_unloads_after_idle_and_the_next_request_pays_the_load_again() -> None:
    with standin("ollama", load_ms=400, idle_unload_s=0.5) as server:
        async with httpx.AsyncClient() as http:
            assert (await http.get(server.url + "/api/ps")).json() == {"models": []}
            body = {"model": "sim", "messages": MESSAGES}
            cold, _ = await timed(http, server, "/v1/chat/completions", body)
            warm, _ = await timed(http, server, "/v1/chat/completions", body)
            assert cold >= 0.38, (cold, warm)
            assert warm * 2 < cold, (cold, warm)
            [loaded] = (await http.get(server.url + "/api/ps")).json()["models"]
            assert loaded["name"] == "sim:latest"
            deadline = time.monotonic() + 15
            while (await http.get(server.url + "/api/ps")).json()["models"]:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            again, _ = await timed(http, server, "/v1/chat/completions", body)
            assert again >= 0.38
        stats = server.stats()
    assert stats["loads"] == 2
    assert stats["unloads"] == 1


async def test_ollama_requests_arriving_during_a_load_share_it() -> None:
    with standin("ollama", load_ms=400) as server:
        async with httpx.AsyncClient() as http:
            body = {"model": "sim", "messages": MESSAGES, "stream": False}
            took = await asyncio.gather(*(timed(http, server, "/api/chat", body) for _ in range(3)))
        assert all(seconds >= 0.38 for seconds, _ in took)  # each waited for the load ...
        assert all(answer["load_duration"] > 0.3e9 for _, answer in took)
        assert server.stats()["loads"] == 1  # ... and there was one


async def test_ollama_keep_alive_sets_the_expiry_on_the_native_api_only() -> None:
    with standin("ollama", load_ms=50) as server:
        async with httpx.AsyncClient() as http:

            async def expires_in() -> float:
                [model] = (await http.get(server.url + "/api/ps")).json()["models"]
                return datetime.fromisoformat(model["expires_at"]).timestamp() - time.time()

            await timed(
                http, server, "/api/generate", {"model": "sim", "prompt": "hi", "keep_alive": "10m", "stream": False}
            )
            assert 590 < await expires_in() <= 600
            await timed(
                http,
                server,
                "/api/chat",
                {"model": "sim:latest", "messages": MESSAGES, "keep_alive": 30, "stream": False},
            )
            assert 25 < await expires_in() <= 30
            # The OpenAI-compatible path takes no keep_alive: the server default (5 minutes) applies.
            await timed(http, server, "/v1/chat/completions", {"model": "sim", "messages": MESSAGES, "keep_alive": 0})
            assert 290 < await expires_in() <= 300
            await timed(
                http, server, "/api/chat", {"model": "sim", "messages": MESSAGES, "keep_alive": 0, "stream": False}
            )
            assert (await http.get(server.url + "/api/ps")).json() == {"models": []}
            refused = await http.post(server.url + "/api/chat", json={"model": "sim", "keep_alive": "soon"})
            assert refused.status_code == 400
            assert "invalid duration" in refused.json()["error"]
        assert server.stats()["unloads"] == 1


async def test_ollama_empty_requests_load_and_unload() -> None:
    with standin("ollama", load_ms=300) as server:
        async with httpx.AsyncClient() as http:
            took, loaded = await timed(http, server, "/api/chat", {"model": "sim", "messages": []})
            assert loaded["done_reason"] == "load"
            assert loaded["done"] is True
            assert took >= 0.28
            assert len((await http.get(server.url + "/api/ps")).json()["models"]) == 1
            _, unloaded = await timed(http, server, "/api/generate", {"model": "sim", "keep_alive": 0})
            assert unloaded["done_reason"] == "unload"
            assert (await http.get(server.url + "/api/ps")).json() == {"models": []}
        stats = server.stats()
    assert stats["warmups"] == 2
    assert stats["loads"] == 1
    assert stats["unloads"] == 1


async def test_ollama_native_streams_are_ndjson_and_unknown_models_404() -> None:
    with standin("ollama", tokens=4) as server:
        async with httpx.AsyncClient() as http:
            async with http.stream(
                "POST", server.url + "/api/chat", json={"model": "sim", "messages": MESSAGES}
            ) as response:
                assert response.headers["content-type"] == "application/x-ndjson"
                lines = [httpx.Response(200, content=line).json() async for line in response.aiter_lines() if line]
            assert [line["done"] for line in lines] == [False] * 4 + [True]
            assert lines[-1]["eval_count"] == 4
            assert lines[-1]["prompt_eval_count"] == 4 + 2
            missing = await http.post(server.url + "/api/chat", json={"model": "nope", "messages": MESSAGES})
            assert missing.status_code == 404
            assert missing.json() == {"error": "model 'nope' not found"}
            tags = (await http.get(server.url + "/api/tags")).json()["models"]
            assert [tag["name"] for tag in tags] == ["sim:latest"]
            assert (await http.get(server.url + "/api/version")).json()["version"]
            assert (await http.get(server.url + "/")).text == "Ollama is running"
        async with client(server) as sdk:
            with pytest.raises(NotFoundError) as missing_v1:
                await sdk.chat.completions.create(model="nope", messages=MESSAGES)
        assert missing_v1.value.body == {
            "message": "model 'nope' not found",
            "type": "not_found_error",
            "param": None,
            "code": None,
        }
