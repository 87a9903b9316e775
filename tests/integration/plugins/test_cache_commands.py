"""`sluice cache prefill | stats | purge` as a user runs them, against a real redis-server and scripted upstream;
then the real gateway, with the openai SDK, hits (or not) what they left."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import orjson
import pytest
import redis.cluster

from plugins.auth.keys import new_key
from plugins.cache import layout
from tests.support.gateway import RunningGateway, gateway_thread
from tests.support.redis import RedisCluster, RedisServer
from tests.support.upstream import Ok, ScriptedUpstream

ACME, ACME_HASH = new_key()
GLOBEX, GLOBEX_HASH = new_key()
QUESTIONS = ["What is a sluice?", "What is a weir?", "What is a lock?"]


def config(upstream: str, redis_url: str) -> str:
    return f"""
backends:
  up: {{type: openai, base_url: "{upstream}/v1"}}
pool: {{warm_connections: 1}}
models:
  chat: {{backend: up}}
  embed: {{backend: up}}
tenants:
  acme: {{keys: ["{ACME_HASH}"]}}
  globex: {{keys: ["{GLOBEX_HASH}"]}}
redis: {{url: "{redis_url}"}}
plugins: [auth, cache]
"""


@pytest.fixture()
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream(default=Ok(ttft_ms=5, tokens=4)) as up:
        yield up


@pytest.fixture()
def config_file(tmp_path: Path, upstream: ScriptedUpstream, redis_server: RedisServer) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(config(upstream.url, redis_server.url))
    return path


def body(question: str, **extra: object) -> dict[str, object]:
    return {"model": "chat", "messages": [{"role": "user", "content": question}], "temperature": 0, **extra}


def jsonl(tmp_path: Path, rows: list[dict[str, object]]) -> Path:
    path = tmp_path / "prefill.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(row) for row in rows) + b"\n")
    return path


def sluice(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *map(str, args)], capture_output=True, text=True, timeout=60
    )


def calls(up: ScriptedUpstream) -> int:
    return sum(1 for r in up.requests if r.path.endswith(("/completions", "/embeddings")))


def cache_state(gw: RunningGateway, key: str, question: str) -> str:
    client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="chat", messages=[{"role": "user", "content": question}], temperature=0
    )
    return raw.headers["x-sluice-cache"]


def test_prefill_then_every_line_is_a_hit_for_its_tenant_only(
    tmp_path: Path, config_file: Path, upstream: ScriptedUpstream
) -> None:
    rows = [body(q) for q in QUESTIONS] + [{"model": "embed", "input": "a sluice"}]
    lines = jsonl(tmp_path, rows)
    first = sluice("cache", "prefill", lines, "-c", config_file, "--tenant", "acme", "--concurrency", "2")
    assert first.returncode == 0, first.stderr
    assert "stored 4, already present 0, failed 0" in first.stdout
    assert calls(upstream) == 4
    # Idempotent: a second run looks each entry up and sends nothing upstream.
    again = sluice("cache", "prefill", lines, "-c", config_file, "--tenant", "acme")
    assert again.returncode == 0, again.stderr
    assert "stored 0, already present 4, failed 0" in again.stdout
    assert calls(upstream) == 4

    with gateway_thread(config_file.read_text()) as gw:
        assert [cache_state(gw, ACME, q) for q in QUESTIONS] == ["hit"] * 3
        assert calls(upstream) == 4  # the first real user got the prefilled answers
        assert cache_state(gw, GLOBEX, QUESTIONS[0]) == "miss"  # never another tenant's entry


def test_dry_run_prints_the_keys_and_sends_nothing(
    tmp_path: Path, config_file: Path, upstream: ScriptedUpstream, redis_server: RedisServer
) -> None:
    lines = jsonl(tmp_path, [body(QUESTIONS[0], tenant="globex"), body(QUESTIONS[1], temperature=0.7)])
    result = sluice("cache", "prefill", lines, "-c", config_file, "--dry-run")
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()
    assert first.startswith("line 1 (globex): sluice:cache:v3:{globex}:chat:")
    assert second == "line 2 (anonymous): not cacheable: needs temperature 0 or a seed (cache mode deterministic)"
    assert calls(upstream) == 0
    assert redis_server.client().dbsize() == 0


def test_purge_of_one_tenant_leaves_the_others(
    tmp_path: Path, config_file: Path, upstream: ScriptedUpstream, redis_server: RedisServer
) -> None:
    rows = [body(q, tenant=tenant) for q in QUESTIONS for tenant in ("acme", "globex")]
    assert sluice("cache", "prefill", jsonl(tmp_path, rows), "-c", config_file).returncode == 0
    stats = sluice("cache", "stats", "-c", config_file)
    assert stats.returncode == 0, stats.stderr
    table = {tuple(line.split()[:3]) for line in stats.stdout.splitlines()}
    assert {("acme", "chat", "3"), ("globex", "chat", "3")} <= table
    assert any(line.split()[:2] == ["total", "6"] for line in stats.stdout.splitlines())

    purged = sluice("cache", "purge", "--tenant", "acme", "-c", config_file)
    assert purged.returncode == 0, purged.stderr
    assert "purged 3 entries of tenant acme" in purged.stdout
    left = [key.decode() for key in redis_server.client().scan_iter(match="sluice:cache:*")]
    assert len(left) == 3
    assert all(layout.parts(key) == ("globex", "chat") for key in left)

    with gateway_thread(config_file.read_text()) as gw:
        assert [cache_state(gw, GLOBEX, q) for q in QUESTIONS] == ["hit"] * 3
        assert cache_state(gw, ACME, QUESTIONS[0]) == "miss"


def test_a_tenant_name_cannot_reach_into_another_tenants_prefix(redis_server: RedisServer, tmp_path: Path) -> None:
    client = redis_server.client()
    for tenant in ("a", "a*", "a}:b", "ab"):
        client.set(layout.prefix(tenant, "chat") + "0" * 64, b"{}")
    path = tmp_path / "gateway.yaml"
    path.write_text(config("http://127.0.0.1:9", redis_server.url))
    purged = sluice("cache", "purge", "--tenant", "a*", "-c", path)
    assert "purged 1 entries of tenant a*" in purged.stdout
    left = sorted(layout.parts(key.decode()) or ("?", "?") for key in client.scan_iter(match="sluice:cache:*"))
    assert left == sorted([("a", "chat"), ("a}:b", "chat"), ("ab", "chat")])


def test_commands_say_one_line_when_something_is_missing(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(config(upstream.url, ""))
    lines = jsonl(tmp_path, [body(QUESTIONS[0])])
    result = sluice("cache", "prefill", lines, "-c", path)
    assert result.returncode == 2
    assert result.stderr.strip() == "sluice cache prefill: prefill stores into Redis: set redis.url in the config"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"model": "chat", "messages": []}\nnot json\n')
    result = sluice("cache", "prefill", bad, "-c", path, "--dry-run")
    assert result.returncode == 2
    assert f"{bad}:2: not valid JSON" in result.stderr


def test_stats_and_purge_on_a_redis_cluster(redis_cluster: RedisCluster, tmp_path: Path) -> None:
    cluster = redis.cluster.RedisCluster.from_url(
        f"redis://127.0.0.1:{redis_cluster.servers[0].port}", socket_timeout=2
    )
    try:
        for tenant in ("acme", "globex", "initech"):
            for i in range(5):
                cluster.set(layout.prefix(tenant, "chat") + f"{i:064x}", b"{}")
        path = tmp_path / "gateway.yaml"
        path.write_text(config("http://127.0.0.1:9", redis_cluster.url))
        stats = sluice("cache", "stats", "-c", path)
        assert stats.returncode == 0, stats.stderr
        rows = {tuple(line.split()[:3]) for line in stats.stdout.splitlines()}
        assert {("acme", "chat", "5"), ("globex", "chat", "5"), ("initech", "chat", "5")} <= rows
        purged = sluice("cache", "purge", "--tenant", "globex", "-c", path)
        assert purged.returncode == 0, purged.stderr
        assert "purged 5 entries of tenant globex" in purged.stdout
        left = {layout.parts(key.decode()) for key in cluster.scan_iter(match="sluice:cache:*")}
        assert left == {("acme", "chat"), ("initech", "chat")}
        assert sum(1 for _ in cluster.scan_iter(match="sluice:cache:*")) == 10
        # Prefill stores through the gateway's own cluster client, under the tenant's tag.
        with ScriptedUpstream(default=Ok(ttft_ms=5, tokens=3)) as up:
            path.write_text(config(up.url, redis_cluster.url))
            lines = jsonl(tmp_path, [body(q) for q in QUESTIONS])
            filled = sluice("cache", "prefill", lines, "-c", path, "--tenant", "globex")
            assert filled.returncode == 0, filled.stderr
            assert "stored 3, already present 0, failed 0" in filled.stdout
            again = sluice("cache", "prefill", lines, "-c", path, "--tenant", "globex")
            assert "stored 0, already present 3, failed 0" in again.stdout
            assert calls(up) == 3
        globex = [key for key in cluster.scan_iter(match=layout.pattern("globex"))]
        assert len(globex) == 3
    finally:
        cluster.close()
