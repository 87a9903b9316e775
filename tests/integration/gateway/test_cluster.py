"""The store on a real Redis Cluster: routing by hash slot, pipelines and scripts across nodes, MOVED, ASK, failover."""

from __future__ import annotations

import asyncio
import subprocess
import time

import openai
import pytest
import redis

from gateway.state.cluster import Cluster, slot
from gateway.state.store import Script, Store, StoreUnavailable
from plugins.auth.keys import add, new_key, revoke
from tests.support.gateway import gateway_thread
from tests.support.redis import RedisCluster

KEYS = [f"key-{i}" for i in range(60)]


async def eventually(store: Store, *command: str | int, timeout_s: float = 30.0) -> object:
    """The reply to `command` once the store serves it again; what failed meanwhile was StoreUnavailable."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await store.execute(*command)
        except StoreUnavailable:
            assert time.monotonic() < deadline, f"{command} still failing"
            await asyncio.sleep(0.05)


async def test_keys_go_to_the_master_of_their_slot(redis_cluster: RedisCluster) -> None:
    store = Store(redis_cluster.url, timeout_s=1.0)
    try:
        for key in KEYS:
            assert await store.execute("SET", key, key + "!") == b"OK"
        assert len({slot(k) for k in KEYS}) > 3
        assert isinstance(store.client, Cluster)
        assert len(store.client.masters) == 3
        for key in KEYS[:10]:
            with redis_cluster.client(redis_cluster.master_of(key).port) as direct:
                assert direct.get(key) == key + "!"  # stored where the cluster says the slot lives
        assert [await store.execute("GET", k) for k in KEYS] == [(k + "!").encode() for k in KEYS]
        assert await store.execute("PING") == b"PONG"
    finally:
        await store.aclose()


async def test_a_pipeline_across_slots_answers_in_order(redis_cluster: RedisCluster) -> None:
    store = Store(redis_cluster.url, timeout_s=1.0)
    try:
        commands: list[tuple[str | int, ...]] = []
        for i, key in enumerate(KEYS):
            commands += [("SET", f"p:{key}", i), ("INCR", f"p:{key}"), ("HGET", f"p:{key}", "f")]
        replies = await store.pipeline(commands)
        assert replies[0::3] == [b"OK"] * len(KEYS)
        assert replies[1::3] == list(range(1, len(KEYS) + 1))
        assert all(str(r).startswith("WRONGTYPE") for r in replies[2::3])  # errors in place
    finally:
        await store.aclose()


async def test_scripts_on_tagged_keys_run_where_the_tag_lives(redis_cluster: RedisCluster) -> None:
    store = Store(redis_cluster.url, timeout_s=1.0)
    script = Script("redis.call('INCRBY', KEYS[1], ARGV[1]); return redis.call('INCRBY', KEYS[2], ARGV[1])")
    try:
        for tenant in ("acme", "globex", "initech"):
            keys = [f"sluice:rl:{{{tenant}}}:a", f"sluice:rl:{{{tenant}}}:b"]
            assert await store.run(script, keys, [2]) == 2
            assert await store.run(script, keys, [3]) == 5
        await store.execute("SCRIPT", "FLUSH")  # on every master
        assert await store.run(script, ["{acme}:x", "{acme}:y"], [1]) == 1
        with pytest.raises(StoreUnavailable, match="CROSSSLOT"):
            await store.run(script, ["{acme}:x", "{globex}:y"], [1])
    finally:
        await store.aclose()


async def test_a_slot_being_migrated_is_followed_with_asking(redis_cluster: RedisCluster) -> None:
    key = "migrating-key"
    number = slot(key)
    source = redis_cluster.master_of(key)
    target = next(s for s in redis_cluster.servers if s is not source and redis_cluster.is_master(s.port))
    with redis_cluster.client(source.port) as src, redis_cluster.client(target.port) as dst:
        source_id, target_id = src.execute_command("CLUSTER", "MYID"), dst.execute_command("CLUSTER", "MYID")
        dst.execute_command("CLUSTER", "SETSLOT", number, "IMPORTING", source_id)
        src.execute_command("CLUSTER", "SETSLOT", number, "MIGRATING", target_id)
    store = Store(redis_cluster.url, timeout_s=1.0)
    try:
        assert await store.execute("SET", key, "moved") == b"OK"  # a new key: ASK, then ASKING + SET there
        assert await store.execute("GET", key) == b"moved"
        with redis.Redis(port=target.port) as dst_raw:
            pipe = dst_raw.pipeline(transaction=False)
            pipe.execute_command("ASKING")
            pipe.get(key)
            assert pipe.execute()[1] == b"moved"
    finally:
        await store.aclose()
        for server in (source, target):  # finish the migration, as redis-cli would
            with redis_cluster.client(server.port) as c:
                c.execute_command("CLUSTER", "SETSLOT", number, "NODE", target_id)
        redis_cluster.wait_until_ok()


async def test_after_a_failover_moved_replies_are_followed_without_a_restart(redis_cluster: RedisCluster) -> None:
    store = Store(redis_cluster.url, timeout_s=1.0)
    try:
        assert await store.execute("SET", "failover-key", "before") == b"OK"
        old = redis_cluster.master_of("failover-key")
        replica = redis_cluster.replica_of(old)
        redis_cluster.wait_until_synced(replica)
        with redis_cluster.client(replica.port) as c:
            c.execute_command("CLUSTER", "FAILOVER")
        redis_cluster.wait_until(lambda: redis_cluster.master_of("failover-key") is replica)
        assert await eventually(store, "GET", "failover-key") == b"before"  # MOVED from the old master
        assert await store.execute("SET", "failover-key", "after") == b"OK"
        assert store.failures == 0  # a clean hand-over: followed, never failed
        with redis_cluster.client(replica.port) as c:
            assert c.get("failover-key") == "after"
    finally:
        await store.aclose()


async def test_a_killed_master_is_replaced_by_its_replica_without_a_restart() -> None:
    try:
        cluster = RedisCluster().__enter__()
    except (RuntimeError, OSError, subprocess.SubprocessError, redis.RedisError) as exc:
        pytest.skip(f"cannot start a Redis Cluster here: {exc}")
    store = Store(cluster.url, timeout_s=0.5, cooldown_s=0.2)
    try:
        keys = KEYS[:20]
        for key in keys:
            await store.execute("SET", key, "1")
        victim = cluster.master_of("key-0")
        replica = cluster.replica_of(victim)
        cluster.wait_until_synced(replica)
        cluster.kill(victim)
        cluster.wait_until(lambda: cluster.master_of("key-0") is replica)
        assert await eventually(store, "INCR", "key-0") == 2  # the replica's copy, promoted
        assert [await store.execute("GET", k) for k in keys[1:]] == [b"1"] * 19  # the other masters still serve
    finally:
        await store.aclose()
        cluster.__exit__()


def test_keys_added_and_revoked_on_a_cluster_reach_the_gateway(redis_cluster: RedisCluster) -> None:
    key, hashed = new_key()
    hexdigest = hashed.removeprefix("sha256:")
    add(redis_cluster.url, "beta", hexdigest, None)  # `sluice keys` on the cluster URL
    config = f"""
backends:
  sim: {{type: simulated, ttft_ms: 1, tpot_ms: 0, tokens: 3}}
models:
  chat: {{backend: sim}}
redis: {{url: "{redis_cluster.url}"}}
auth: {{required: true, cache_ttl_s: 60}}
plugins: [auth]
"""
    with gateway_thread(config) as gw:
        client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
        ask = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
        assert client.chat.completions.create(**ask).choices  # type: ignore[call-overload]
        deadline = time.monotonic() + 10
        while True:  # the listener subscribes in the background; a revocation before that is only TTL-bound
            revoke(redis_cluster.url, hexdigest)
            try:
                client.chat.completions.create(**ask)  # type: ignore[call-overload]
            except openai.AuthenticationError:
                break
            assert time.monotonic() < deadline, "revoked key still accepted"
            add(redis_cluster.url, "beta", hexdigest, None)
            time.sleep(0.05)
        client.close()
