"""Gateway keys -> tenants: config and Redis keys, cached lookups, revocation across processes, Redis faults."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

from plugins.auth.keys import add, new_key, revoke
from tests.support.gateway import gateway_process, gateway_thread
from tests.support.redis import RedisServer
from tests.support.wait import wait_until

KEY, HASH = new_key()
OTHER_KEY, OTHER_HASH = new_key()


def config(redis_url: str = "", required: bool = True, ttl: float = 30) -> str:
    return f"""
backends:
  sim: {{type: simulated, ttft_ms: 1, tpot_ms: 0, tokens: 3}}
models:
  chat: {{backend: sim}}
  secret: {{backend: sim}}
tenants:
  acme: {{keys: ["{HASH}"]}}
  limited: {{keys: ["{OTHER_HASH}"], models: [chat]}}
redis: {{url: "{redis_url}"}}
auth: {{required: {str(required).lower()}, cache_ttl_s: {ttl}}}
plugins: [auth]
"""


def chat(base_url: str, key: str, model: str = "chat") -> str:
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    return answer.choices[0].message.content or ""


def hget_calls(server: RedisServer) -> int:
    stats = server.client().info("commandstats")
    return int(stats.get("cmdstat_hget", {}).get("calls", 0))


def test_config_keys_bearer_and_api_key_header() -> None:
    with gateway_thread(config()) as gw:
        assert chat(gw.base_url, KEY)
        azure = openai.AzureOpenAI(azure_endpoint=gw.url, api_version="2024-10-21", api_key=KEY, max_retries=0)
        assert azure.chat.completions.create(model="chat", messages=[{"role": "user", "content": "x"}]).choices
        only_api_key = httpx.post(
            f"{gw.base_url}/chat/completions",
            headers={"api-key": KEY},
            json={"model": "chat", "messages": [{"role": "user", "content": "x"}]},
        )
        assert only_api_key.status_code == 200
        assert "auth;dur=" in only_api_key.headers["server-timing"]


def test_missing_unknown_and_forbidden() -> None:
    with gateway_thread(config()) as gw:
        body = {"model": "chat", "messages": [{"role": "user", "content": "x"}]}
        missing = httpx.post(f"{gw.base_url}/chat/completions", json=body)
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError) as caught:
            chat(gw.base_url, "sk-wrong-key")
        assert caught.value.code == "invalid_api_key"
        assert "sk-wrong-key" not in str(caught.value.body)
        with pytest.raises(openai.PermissionDeniedError):
            chat(gw.base_url, OTHER_KEY, model="secret")
        assert chat(gw.base_url, OTHER_KEY, model="chat")


def test_not_required_lets_anonymous_through() -> None:
    with gateway_thread(config(required=False)) as gw:
        assert chat(gw.base_url, "anything")
        with pytest.raises(openai.PermissionDeniedError):  # a known key still carries its restrictions
            chat(gw.base_url, OTHER_KEY, model="secret")


def test_redis_keys_and_negative_cache(redis_server: RedisServer) -> None:
    key, hashed = new_key()
    add(redis_server.url, "beta", hashed.removeprefix("sha256:"), None)
    with gateway_thread(config(redis_server.url)) as gw:
        before = hget_calls(redis_server)
        for _ in range(5):
            assert chat(gw.base_url, key)
        assert hget_calls(redis_server) - before == 1  # then served from the cache

        before = hget_calls(redis_server)
        url = f"{gw.base_url}/chat/completions"
        body = {"model": "chat", "messages": [{"role": "user", "content": "x"}]}
        with httpx.Client() as client:
            for i in range(60):
                bad = client.post(url, json=body, headers={"authorization": f"Bearer bad-{i % 20}"})
                assert bad.status_code == 401
        assert hget_calls(redis_server) - before == 20  # one lookup per unknown key, not per request


def test_revocation_reaches_another_process_within_a_second(redis_server: RedisServer, tmp_path: Path) -> None:
    key, hashed = new_key()
    hexdigest = hashed.removeprefix("sha256:")
    add(redis_server.url, "beta", hexdigest, None)
    with (
        gateway_process(config(redis_server.url), tmp_path) as one,
        gateway_process(config(redis_server.url), tmp_path) as two,
    ):
        assert chat(one.base_url, key)
        assert chat(two.base_url, key)  # both have it cached now
        revoke(redis_server.url, hexdigest)

        def refused(url: str) -> bool:
            try:
                chat(url, key)
            except openai.AuthenticationError:
                return True
            return False

        # Well within the 30 s cache TTL: pub/sub told every process (2 s leaves room for a loaded machine).
        wait_until(lambda: refused(two.base_url), timeout=2.0, what="the revoked key refused")
        with pytest.raises(openai.AuthenticationError):
            chat(one.base_url, key)
        # A key added after being refused (a negative entry) works at once too.
        add(redis_server.url, "beta", hexdigest, None)
        wait_until(lambda: not refused(two.base_url), timeout=2.0, what="the key accepted again")


def test_redis_down_cached_and_config_keys_work_unknown_get_503(redis_server: RedisServer) -> None:
    key, hashed = new_key()
    add(redis_server.url, "beta", hashed.removeprefix("sha256:"), None)
    with gateway_thread(config(redis_server.url)) as gw:
        assert chat(gw.base_url, key)
        redis_server.stop()
        started = time.monotonic()
        assert chat(gw.base_url, key)  # cached
        assert chat(gw.base_url, KEY)  # from the config
        unknown = httpx.post(
            f"{gw.base_url}/chat/completions",
            headers={"authorization": "Bearer never-seen"},
            json={"model": "chat", "messages": [{"role": "user", "content": "x"}]},
        )
        assert unknown.status_code == 503
        assert unknown.json()["error"]["code"] == "auth_unavailable"
        assert time.monotonic() - started < 2.0
        redis_server.start()
        wait_until(gw.store_available, what="the circuit breaker's cool-down")
        fresh, fresh_hash = new_key()
        add(redis_server.url, "beta", fresh_hash.removeprefix("sha256:"), None)
        assert chat(gw.base_url, fresh)
