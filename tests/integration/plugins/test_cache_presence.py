"""The presence filter end to end: gateways on a real Redis (and Valkey, and a Redis Cluster) skip the GET of a key
no gateway stored, hear each other's stores, and fall back to asking Redis whenever the filter may have missed one:
Redis stalled (SIGSTOP), stopped, restarted empty."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
import redis

from gateway.state.store import Store
from plugins.auth.keys import new_key
from plugins.cache import Cache
from plugins.cache.presence import Presence
from tests.support.gateway import RunningGateway, gateway_thread
from tests.support.redis import RedisCluster, RedisServer
from tests.support.upstream import Ok, ScriptedUpstream
from tests.support.wait import until, wait_until

# Tenants whose entries land in different hash slots (a tenant is its keys' hash tag): on a cluster, on several masters.
TENANTS = {f"t{n}": new_key() for n in range(6)}


def config(upstream: str, redis_url: str, presence: bool = True) -> str:
    tenants = "".join(f'  {name}: {{keys: ["{digest}"]}}\n' for name, (_, digest) in TENANTS.items())
    return f"""
backends:
  up: {{type: openai, base_url: "{upstream}/v1", api_key: backend-key}}
pool: {{warm_connections: 1}}
models:
  chat: {{backend: up, upstream_model: real-model}}
tenants:
{tenants}redis: {{url: "{redis_url}"}}
cache: {{presence: {str(presence).lower()}}}
plugins: [auth, cache]
"""


@pytest.fixture()
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream(default=Ok(ttft_ms=5, tpot_ms=1, tokens=3)) as up:
        yield up


def presence_of(gw: RunningGateway) -> Presence:
    assert gw.app is not None
    assert gw.app.runtime is not None
    cache = next(p for p in gw.app.runtime.plugins if isinstance(p, Cache))
    assert cache.presence is not None
    return cache.presence


def synced(gw: RunningGateway, timeout: float = 30.0) -> Presence:
    presence = presence_of(gw)
    wait_until(lambda: presence.trusted, timeout, what="the presence filter synced")
    return presence


def ask(gw: RunningGateway, question: str, tenant: str = "t0") -> str:
    """x-sluice-cache of one deterministic chat request."""
    answer = httpx.post(
        f"{gw.base_url}/chat/completions",
        json={"model": "chat", "messages": [{"role": "user", "content": question}], "temperature": 0},
        headers={"authorization": f"Bearer {TENANTS[tenant][0]}"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    return answer.headers["x-sluice-cache"]


def shown(gw: RunningGateway) -> float:
    """sluice_cache_presence_synced as the gateway's /metrics shows it."""
    for line in httpx.get(f"{gw.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("sluice_cache_presence_synced "):
            return float(line.split()[1])
    raise AssertionError("no sluice_cache_presence_synced in /metrics")


def gets(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_get", {}).get("calls", 0))


def stored(client: redis.Redis, n: int) -> None:
    wait_until(lambda: len(client.keys("sluice:cache:v3:*")) >= n, what=f"{n} entries in Redis")


def test_misses_skip_redis_and_gateways_hear_each_others_stores(
    upstream: ScriptedUpstream, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    with (
        gateway_thread(config(upstream.url, redis_server.url)) as one,
        gateway_thread(config(upstream.url, redis_server.url)) as two,
    ):
        synced(one)
        heard = synced(two)
        client.config_resetstat()
        for i in range(5):
            assert ask(one, f"question {i}") == "miss"
        stored(client, 5)
        assert gets(client) == 0  # five misses, no lookup: nobody had stored those keys
        assert presence_of(one).skipped == 5
        wait_until(lambda: heard.heard >= 5, what="two hearing one's stores")
        for i in range(5):
            assert ask(two, f"question {i}") == "hit"  # from Redis: two never saw them itself
        assert gets(client) == 5
        assert ask(two, "never asked") == "miss"
        assert gets(client) == 5


def test_keys_stored_before_a_gateway_started_are_found_by_its_scan(
    upstream: ScriptedUpstream, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    with gateway_thread(config(upstream.url, redis_server.url, presence=False)) as writer:
        for i in range(3):
            assert ask(writer, f"early {i}") == "miss"
        stored(client, 3)
    with gateway_thread(config(upstream.url, redis_server.url)) as late:
        presence = synced(late)
        assert presence.resyncs == 1
        for i in range(3):
            assert ask(late, f"early {i}") == "hit"


def test_keys_stored_while_a_subscription_was_down_are_found_by_the_next_scan(
    upstream: ScriptedUpstream, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    with (
        gateway_thread(config(upstream.url, redis_server.url, presence=False)) as writer,
        gateway_thread(config(upstream.url, redis_server.url)) as reader,
    ):
        presence = synced(reader)
        resyncs = presence.resyncs
        # Suspend the writer's announcements to nobody: the reader's subscription is killed, and a question is
        # answered and stored before it is back (it retries after a second).
        assert client.client_kill_filter(_type="pubsub") >= 1
        wait_until(lambda: not presence.trusted, what="the killed subscription noticed")
        assert ask(writer, "in the gap") == "miss"
        stored(client, 1)
        wait_until(lambda: presence.trusted and presence.resyncs > resyncs, 30, what="resubscribed and rescanned")
        assert ask(reader, "in the gap") == "hit"  # the SCAN found what no announcement told


def test_a_stalled_stopped_or_emptied_redis_makes_the_filter_ask_again(
    upstream: ScriptedUpstream, redis_server: RedisServer
) -> None:
    with (
        gateway_thread(config(upstream.url, redis_server.url)) as one,
        gateway_thread(config(upstream.url, redis_server.url)) as two,
    ):
        presence = synced(two)
        assert shown(two) == 1.0
        redis_server.pause()
        try:
            # Answered all the while; the subscription's PING goes unanswered and the filter stops being believed.
            for i in range(3):
                assert ask(two, f"stalled {i}") == "miss"
            wait_until(lambda: not presence.trusted, 30, what="the stall noticed")
            assert presence.maybe("sluice:cache:v3:{x}:chat:" + "0" * 64)
        finally:
            redis_server.resume()
        wait_until(lambda: presence.trusted, 30, what="synced again after the stall")
        resyncs = presence.resyncs
        assert resyncs >= 2

        redis_server.stop()
        wait_until(lambda: not presence.trusted, 30, what="the stop noticed")
        assert shown(two) == 0.0  # what SluiceCachePresenceUnsynced watches
        assert ask(two, "while stopped") == "miss"
        redis_server.start()  # empty: nothing kept on disk
        wait_until(lambda: presence.trusted and presence.resyncs > resyncs, 30, what="synced with the new Redis")
        wait_until(lambda: one.store_available() and two.store_available(), what="the breakers' cool-down")
        assert ask(one, "after the restart") == "miss"
        client = redis_server.client()
        stored(client, 1)
        (entry,) = client.keys("sluice:cache:v3:*")
        assert isinstance(entry, bytes)
        wait_until(lambda: presence.maybe(entry.decode()), what="two hearing one's store")
        assert ask(two, "after the restart") == "hit"


def test_on_a_cluster_every_gateway_hears_and_scans_every_master(
    upstream: ScriptedUpstream, redis_cluster: RedisCluster
) -> None:
    url = redis_cluster.url
    with (
        gateway_thread(config(upstream.url, url)) as one,
        gateway_thread(config(upstream.url, url)) as two,
    ):
        synced(one)
        heard = synced(two)
        for tenant in TENANTS:
            assert ask(one, "on a cluster", tenant) == "miss"
        wait_until(lambda: heard.heard >= len(TENANTS), what="two hearing one's stores through the cluster bus")
        for tenant in TENANTS:
            assert ask(two, "on a cluster", tenant) == "hit"
    wait_until(lambda: len(keys_on(redis_cluster)) == len(TENANTS), what="every tenant's entry in the cluster")
    masters = {redis_cluster.master_of(key).port for key in keys_on(redis_cluster)}
    assert len(masters) > 1  # the late gateway's SCAN must walk more than one master to find them all
    with gateway_thread(config(upstream.url, url)) as late:
        synced(late)
        for tenant in TENANTS:
            assert ask(late, "on a cluster", tenant) == "hit"


def keys_on(cluster: RedisCluster) -> list[str]:
    found: list[str] = []
    for server in cluster.servers:
        if cluster.is_master(server.port):
            found += [str(key) for key in cluster.client(server.port).keys("sluice:cache:v3:*")]
    return found


def scanning(store: Store) -> bool:
    """A command (the SCAN's step) written and not yet answered: Redis is stalled with it."""
    node = getattr(store.client, "node")  # noqa: B009 (a single server's client: resp.Redis)
    return any(connection.pending for connection in node.live)


def test_trusted_only_once_the_scan_after_the_subscription_has_ended(redis_server: RedisServer) -> None:
    """Redis stalled (SIGSTOP) in the middle of the SCAN: the filter waits for its end, whatever else it hears."""
    stored_key = "sluice:cache:v3:{t0}:chat:" + "ab" * 32

    async def run() -> None:
        store = Store(redis_server.url, timeout_s=30.0)  # a step waits out the stall instead of failing
        await store.execute("SET", stored_key, b"x")
        presence = Presence(10_000, lifetime_s=60.0)
        presence.store = store
        redis_server.pause()
        try:
            presence._subscribed(presence.epoch)  # as the listener does once the subscription is confirmed
            await until(lambda: scanning(store), 10, what="the SCAN's step sent")
            assert not presence.trusted
        finally:
            redis_server.resume()
        await until(lambda: presence.trusted, 10, what="the SCAN ended, then trust")
        assert presence.maybe(stored_key)
        assert not presence.maybe("sluice:cache:v3:{t0}:chat:" + "cd" * 32)
        presence.stop()
        await store.aclose()

    asyncio.run(run())


def test_a_gap_during_the_scan_keeps_the_filter_untrusted(redis_server: RedisServer) -> None:
    """The subscription lost while the SCAN runs: the SCAN still ends well, and yet the filter is not believed."""

    async def run() -> None:
        store = Store(redis_server.url, timeout_s=30.0)
        await store.execute("PING")
        presence = Presence(10_000, lifetime_s=60.0)
        presence.store = store
        redis_server.pause()
        try:
            presence._subscribed(presence.epoch)
            await until(lambda: scanning(store), 10, what="the SCAN's step sent")
            presence._untrust("the subscription was lost")  # as the listener does when the connection drops
        finally:
            redis_server.resume()
        sync = presence._sync
        assert sync is not None
        await until(sync.done, 10, what="the SCAN over")
        assert store.failures == 0  # it ended well: only the gap keeps the filter from being believed
        assert not presence.trusted  # what was published in the gap is unknown until the next SCAN
        presence.stop()
        await store.aclose()

    asyncio.run(run())
