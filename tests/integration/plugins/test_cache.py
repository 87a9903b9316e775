"""The exact-prompt cache end to end: real gateway, scripted upstream, real redis-server, the openai SDK."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from plugins.auth.keys import new_key
from tests.support.gateway import RunningGateway, gateway_thread
from tests.support.redis import RedisServer
from tests.support.upstream import Ok, ResetMidStream, ScriptedUpstream
from tests.support.wait import wait_until

ACME, ACME_HASH = new_key()
GLOBEX, GLOBEX_HASH = new_key()
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is a sluice?"}]


def config(upstream: str, redis_url: str = "") -> str:
    return f"""
backends:
  up: {{type: openai, base_url: "{upstream}/v1", api_key: backend-key}}
pool: {{warm_connections: 1}}
models:
  chat: {{backend: up, upstream_model: real-model}}
  embed: {{backend: up}}
tenants:
  acme: {{keys: ["{ACME_HASH}"]}}
  globex: {{keys: ["{GLOBEX_HASH}"]}}
redis: {{url: "{redis_url}"}}
cache: {{follower_wait_s: 5}}
plugins: [auth, cache]
"""


@pytest.fixture()
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream(default=Ok(ttft_ms=20, tpot_ms=2, tokens=6)) as up:
        yield up


@pytest.fixture()
def gateway(upstream: ScriptedUpstream) -> Iterator[RunningGateway]:
    with gateway_thread(config(upstream.url)) as gw:
        yield gw


def calls(up: ScriptedUpstream) -> int:
    return sum(1 for r in up.requests if r.path.endswith(("/completions", "/embeddings")))


def ask(gw: RunningGateway, stream: bool, key: str = ACME, **extra: object) -> tuple[str, str, str | None]:
    """(content, x-sluice-cache, finish_reason) of one chat request made with the openai SDK."""
    client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
    params: dict[str, object] = {"model": "chat", "messages": MESSAGES, "temperature": 0, **extra}
    if not stream:
        raw = client.chat.completions.with_raw_response.create(**params)  # type: ignore[call-overload]
        answer = raw.parse()
        return answer.choices[0].message.content, raw.headers["x-sluice-cache"], answer.choices[0].finish_reason
    with client.chat.completions.with_streaming_response.create(stream=True, **params) as raw:  # type: ignore[call-overload]
        parts, finish = [], None
        for chunk in raw.parse():
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        return "".join(parts), raw.headers["x-sluice-cache"], finish


@pytest.mark.parametrize("fill", [False, True], ids=["fill-json", "fill-sse"])
@pytest.mark.parametrize("replay", [False, True], ids=["replay-json", "replay-sse"])
def test_second_identical_request_is_a_hit_in_either_form(
    gateway: RunningGateway, upstream: ScriptedUpstream, fill: bool, replay: bool
) -> None:
    content, state, finish = ask(gateway, fill)
    assert state == "miss"
    assert content
    assert finish == "stop"
    gateway.settle()  # the entry is written after the response ends
    again, state, again_finish = ask(gateway, replay)
    assert state == "hit"
    assert again == content
    assert again_finish == finish
    assert calls(upstream) == 1


@pytest.mark.parametrize("fill", [False, True], ids=["fill-json", "fill-sse-without-usage"])
def test_replayed_stream_carries_usage_when_asked(
    gateway: RunningGateway, upstream: ScriptedUpstream, fill: bool
) -> None:
    ask(gateway, fill)  # a stream filled by a client that did not ask for usage still stores it
    gateway.settle()
    client = openai.OpenAI(base_url=gateway.base_url, api_key=ACME, max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="chat", messages=MESSAGES, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    assert calls(upstream) == 1


def test_tenants_never_share_entries(gateway: RunningGateway, upstream: ScriptedUpstream) -> None:
    assert ask(gateway, False, key=ACME)[1] == "miss"
    gateway.settle()
    assert ask(gateway, False, key=GLOBEX)[1] == "miss"
    assert calls(upstream) == 2


def test_field_order_and_whitespace_do_not_matter(gateway: RunningGateway, upstream: ScriptedUpstream) -> None:
    url = f"{gateway.base_url}/chat/completions"
    headers = {"authorization": f"Bearer {ACME}", "content-type": "application/json"}
    first = b'{"model":"chat","temperature":0,"messages":[{"role":"user","content":"x"}]}'
    second = b'{ "messages": [ {"content": "x", "role": "user"} ],\n "temperature": 0, "model": "chat" }'
    assert httpx.post(url, content=first, headers=headers).headers["x-sluice-cache"] == "miss"
    gateway.settle()
    assert httpx.post(url, content=second, headers=headers).headers["x-sluice-cache"] == "hit"
    third = b'{"model":"chat","temperature":0,"messages":[{"role":"user","content":"y"}]}'
    assert httpx.post(url, content=third, headers=headers).headers["x-sluice-cache"] == "miss"
    # Whom and which conversation it is for does not change the answer (agent clients send a key per conversation).
    fourth = first[:-1] + b',"user":"u1","prompt_cache_key":"conv-2","safety_identifier":"s1"}'
    assert httpx.post(url, content=fourth, headers=headers).headers["x-sluice-cache"] == "hit"


def test_sampled_requests_are_never_cached(gateway: RunningGateway, upstream: ScriptedUpstream) -> None:
    for _ in range(2):
        assert ask(gateway, False, temperature=0.7)[1] == "bypass"
    assert ask(gateway, False, temperature=0.7, seed=7)[1] == "miss"  # a seed makes it deterministic
    assert calls(upstream) == 3


def test_cache_control_headers(gateway: RunningGateway, upstream: ScriptedUpstream) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key=ACME, max_retries=0)

    def state(control: str) -> str:
        raw = client.chat.completions.with_raw_response.create(
            model="chat", messages=MESSAGES, temperature=0, extra_headers={"cache-control": control}
        )
        return raw.headers["x-sluice-cache"]

    assert state("no-store") == "bypass"
    gateway.settle()
    assert state("no-cache") == "miss"  # not looked up, but stored
    gateway.settle()
    assert state("max-age=0, no-cache") == "miss"
    gateway.settle()
    assert ask(gateway, False)[1] == "hit"
    assert calls(upstream) == 3


def test_embeddings_are_cached(gateway: RunningGateway, upstream: ScriptedUpstream) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key=ACME, max_retries=0)
    first = client.embeddings.with_raw_response.create(model="embed", input=["a", "b"])
    gateway.settle()
    second = client.embeddings.with_raw_response.create(model="embed", input=["a", "b"])
    assert (first.headers["x-sluice-cache"], second.headers["x-sluice-cache"]) == ("miss", "hit")
    assert first.parse().data[1].embedding == second.parse().data[1].embedding
    assert calls(upstream) == 1


def test_broken_stream_is_never_stored(gateway: RunningGateway, upstream: ScriptedUpstream) -> None:
    upstream.script(ResetMidStream(after_chunks=2))
    with pytest.raises(openai.APIError):
        ask(gateway, True)
    gateway.settle()
    _, state, finish = ask(gateway, True)
    assert state == "miss"
    assert finish == "stop"
    assert calls(upstream) == 2


async def test_identical_concurrent_streams_share_one_upstream_call(upstream: ScriptedUpstream) -> None:
    upstream.default = Ok(ttft_ms=300, tpot_ms=100, tokens=8)  # 0.7 s from the first token to the end
    with gateway_thread(config(upstream.url)) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=ACME, max_retries=0)

        async def one() -> tuple[float, str]:
            started = time.perf_counter()
            first = 0.0
            parts = []
            stream = await client.chat.completions.create(model="chat", messages=MESSAGES, temperature=0, stream=True)
            async for chunk in stream:
                content = chunk.choices[0].delta.content if chunk.choices else None
                if content and not first:
                    first = time.perf_counter() - started
                parts.append(content or "")
            return first, "".join(parts)

        results = await asyncio.gather(*(one() for _ in range(10)))
        await client.close()
    assert calls(upstream) == 1
    firsts = sorted(first for first, _ in results)
    assert firsts[0] >= 0.28  # nobody got an answer before the upstream gave one
    # Followers get the first token with the leader, not after its end (0.7 s later); the bound leaves room
    # for ten SDK clients sharing one loaded CPU.
    assert firsts[-1] - firsts[0] < 0.35
    assert len({text for _, text in results}) == 1


def entries(redis_server: RedisServer) -> int:
    with redis_server.client() as client:
        return len(client.keys("sluice:cache:*"))


def test_redis_l2_shared_between_gateways_and_faults(upstream: ScriptedUpstream, redis_server: RedisServer) -> None:
    with (
        gateway_thread(config(upstream.url, redis_server.url)) as one,
        gateway_thread(config(upstream.url, redis_server.url)) as two,
    ):
        assert ask(one, False)[1] == "miss"
        wait_until(lambda: entries(redis_server) == 1, what="the entry in Redis")
        assert ask(two, True)[1] == "hit"  # from Redis: two never saw it
        assert calls(upstream) == 1

        redis_server.stop()
        started = time.monotonic()
        for i in range(20):
            _, state, finish = ask(two, i % 2 == 0, messages=[{"role": "user", "content": f"down {i}"}])
            assert finish == "stop"
            assert state == "miss"
        assert time.monotonic() - started < 10
        redis_server.start()
        wait_until(lambda: one.store_available() and two.store_available(), what="the breakers' cool-down")
        fresh = [{"role": "user", "content": "after restart"}]
        assert ask(one, False, messages=fresh)[1] == "miss"
        wait_until(lambda: entries(redis_server) == 1, what="the entry in the restarted Redis")
        assert ask(two, False, messages=fresh)[1] == "hit"


def test_a_miss_reads_redis_once_and_the_entry_is_stored_as_sent(
    upstream: ScriptedUpstream, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    with gateway_thread(config(upstream.url, redis_server.url)) as gw:
        client.config_resetstat()
        first = httpx.post(
            f"{gw.base_url}/chat/completions",
            json={"model": "chat", "messages": MESSAGES, "temperature": 0},
            headers={"authorization": f"Bearer {ACME}"},
        )
        assert first.headers["x-sluice-cache"] == "miss"
        for i in range(11):
            assert ask(gw, i % 2 == 1, messages=[{"role": "user", "content": f"unique {i}"}])[1] == "miss"
        deadline = time.monotonic() + 5
        while len(client.keys("sluice:cache:*")) < 12 and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = client.info("commandstats")
        assert stats["cmdstat_get"]["calls"] == 12  # one L2 read per miss, nothing else on the request path
        assert stats["cmdstat_set"]["calls"] == 12
    records = [client.get(key) for key in client.keys("sluice:cache:v3:*")]
    assert len(records) == 12
    answers = []
    for record in records:
        assert isinstance(record, bytes)
        header, _, answer = record.partition(b"\n")
        endpoint, served, fresh_until = orjson.loads(header)
        assert (endpoint, served) == ("chat/completions", "chat")
        assert fresh_until > time.time()
        stored = orjson.loads(answer)
        assert stored["choices"][0]["finish_reason"] == "stop"
        assert stored["usage"]["completion_tokens"] == 6
        answers.append(answer)
    assert first.content in answers  # a whole answer is stored byte for byte as the client got it
