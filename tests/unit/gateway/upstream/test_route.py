"""Route policies and the endpoint set: hashing, stickiness, discovery and ejection, without a gateway."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from typing import Any

import pytest

from gateway.settings import OpenAIBackend, RoutingSettings
from gateway.upstream.endpoints import Endpoints
from gateway.upstream.health import Health
from gateway.upstream.pool import PoolLimits
from gateway.upstream.prefix import block_ends, prompt_blocks
from gateway.upstream.replica import Endpoint, parse_load
from gateway.upstream.route import Prefix, Session
from tests.support.upstream import ScriptedUpstream
from tools.bench.routing import long_prompt_affinity

LIMITS = PoolLimits(warm=1, connect_timeout=1.0)


def chat(*contents: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text} for text in contents]}


def test_prompt_blocks_chain_so_a_later_turn_shares_the_earlier_turns_blocks() -> None:
    ends = block_ends(256, 64)
    first = "a" * 700
    one, _, whole = prompt_blocks(chat(first), ends)
    two, marks, _ = prompt_blocks(chat(first, "b" * 700), ends)
    assert len(one) == 2
    assert len(two) == 4  # 1,411 characters: blocks end at 256, 512, 768 and 1,024 (the next, at 1,536)
    assert two[:2] == one
    other = prompt_blocks(chat("c" + first[1:], "b" * 700), ends)[0]
    assert not set(other) & set(two)  # a block's hash covers everything before it
    assert prompt_blocks({"model": "n", "messages": chat(first)["messages"]}, ends)[0] != one  # and the model
    # Only the leading prompt is cut into blocks, however long the request; its marks cover all of it.
    head = prompt_blocks(chat("x" * 2000), ends)[0][:4]
    huge = prompt_blocks(chat("x" * 1_000_000), block_ends(256, 4))
    assert huge[0] == head
    assert huge[2]
    assert huge[1] == [(len("user\x1e") + 1_000_000, huge[2])]
    assert prompt_blocks({"model": "m", "prompt": "p" * 300}, block_ends(256, 4))[0] != []
    parts = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a" * 700}]}]}
    assert prompt_blocks(parts, ends)[0] == one
    # The next turn looks up the previous one whole: the prompt its assistant message answered.
    answer = {"role": "assistant", "content": "an answer"}
    turn = {"model": "m", "messages": [*chat(first)["messages"], answer, {"role": "user", "content": "more"}]}
    assert prompt_blocks(turn, ends)[1][0] == (len("user") + 1 + 700, whole)
    assert [offset for offset, _ in marks] == [len("user\x1e" + first + "\x1euser\x1e") + 700]


def test_prompts_past_the_hashed_blocks_are_told_apart_by_their_marks() -> None:
    ends = block_ends(512, 32)  # the default: 16 KiB in blocks
    system = {"role": "system", "content": "shared tool definitions " * 900}  # 21,600 characters
    first = [system, {"role": "user", "content": "question one"}]
    other = [system, {"role": "user", "content": "question two"}]
    one = prompt_blocks({"model": "m", "messages": first}, ends)
    two = prompt_blocks({"model": "m", "messages": other}, ends)
    assert one[0] == two[0]  # the same blocks: the shared head
    assert one[2] != two[2]  # the whole prompts differ
    later = [*first, {"role": "assistant", "content": "an answer"}, {"role": "user", "content": "and then?"}]
    _, marks, _ = prompt_blocks({"model": "m", "messages": later}, ends)
    # The next turn looks up the previous one whole, 21 KiB in: past every block.
    assert marks[0] == (len("\x1e".join(("system", system["content"], "user", "question one"))), one[2])


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_conversations_sharing_a_prompt_longer_than_the_blocks_stay_on_their_replica(replicas: int) -> None:
    # A 20 KiB shared system prompt, 15 conversations of 5 turns in bursts: 60 later turns (random: 60 / replicas).
    stayed, later, _ = long_prompt_affinity(replicas=replicas)
    assert later == 60
    assert stayed >= 55


def test_block_ends_are_fine_at_the_head_and_coarser_deeper_in() -> None:
    ends = block_ends(512, 32)
    assert ends[:5] == [512, 1024, 1536, 2048, 3072]
    assert all(b - a >= 512 and b % 512 == 0 for a, b in itertools.pairwise([0, *ends]))
    assert ends[-1] == 16384
    assert len(ends) == 10


def test_parse_load_reads_only_the_vllm_gauges() -> None:
    text = """# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a"} 3.0
vllm:num_requests_waiting{model_name="b"} 2.0
vllm:num_requests_running{engine="0",model_name="a"} 7.0 1700000000000
vllm:gpu_cache_usage_perc 0.25
vllm:kv_cache_usage_perc{model_name="a"} 0.5
vllm:prompt_tokens_total{model_name="a"} 12345.0
"""
    assert parse_load(text) == (5.0, 7.0, 0.5)
    assert parse_load("process_cpu_seconds_total 1.0\n") is None


async def test_sessions_stick_and_move_minimally_when_endpoints_change() -> None:
    endpoints = [Endpoint(f"http://10.0.0.{i}:8000/v1", LIMITS, None, False) for i in range(5)]
    policy = Session("x-session-id", 3.0)
    keys = [f"user-{i}".encode() for i in range(500)]
    before = {key: policy.pick(key, endpoints, 0.0)[0] for key in keys}
    assert before == {key: policy.pick(key, endpoints, 0.0)[0] for key in keys}
    assert min(Counter(before.values()).values()) > 50  # spread over all five
    gone = endpoints[2]
    after = {key: policy.pick(key, [e for e in endpoints if e is not gone], 0.0)[0] for key in keys}
    moved = [key for key in keys if before[key] is not after[key]]
    assert moved
    assert all(before[key] is gone for key in moved)
    for endpoint in endpoints:
        await endpoint.aclose()


async def test_prefix_prefers_the_endpoint_that_was_sent_the_prefix_within_the_load_bound() -> None:
    endpoints = [Endpoint(f"http://10.0.0.{i}:8000/v1", LIMITS, None, False) for i in range(4)]
    policy = Prefix(RoutingSettings(policy="prefix"), 3.0)
    now = time.monotonic()
    ends = block_ends(512, 32)
    key = prompt_blocks(chat("s" * 2000), ends)
    policy.served(key, endpoints[3], now)
    assert all(policy.pick(key, endpoints, now)[0] is endpoints[3] for _ in range(8))
    # A longer prompt with the same head: the endpoint with more of it wins, the one with less comes next.
    longer = prompt_blocks(chat("s" * 2000, "t" * 3000), ends)
    policy.served(longer, endpoints[1], now)
    assert policy.pick(longer, endpoints, now)[0] is endpoints[1]
    assert policy.pick(longer, [e for e in endpoints if e is not endpoints[1]], now)[0] is endpoints[3]
    # Seen too long ago: the entry has expired, so any endpoint will do.
    assert {policy.pick(key, endpoints, now + 601.0)[0] for _ in range(8)} == set(endpoints)
    assert not policy.where
    policy.served(key, endpoints[3], now + 601.0)
    # Heavily loaded (its own server says so): the bound sends the request elsewhere.
    endpoints[3].scraped(20.0, 0.0, 0.0, now + 601.0)
    assert policy.pick(key, endpoints, now + 601.0)[0] is not endpoints[3]
    for endpoint in endpoints:
        await endpoint.aclose()


async def test_prefix_weighs_blocks_held_against_requests_in_flight() -> None:
    endpoints = [Endpoint(f"http://10.0.0.{i}:8000/v1", LIMITS, None, False) for i in range(2)]
    held, idle = endpoints
    policy = Prefix(RoutingSettings(policy="prefix"), 3.0)
    ends = block_ends(512, 32)
    system = {"role": "system", "content": "the rules " * 90}  # 900 characters: one block
    talk = [system]
    for turn in range(8):
        talk += [{"role": "user", "content": f"question {turn} " * 40}, {"role": "assistant", "content": "ok " * 40}]
    talk.append({"role": "user", "content": "and now?"})
    policy.served(prompt_blocks({"model": "m", "messages": talk[:-2]}, ends), held, 0.0)
    # Three requests in flight there (two scraped from other gateways' share, counted with this one's own).
    held.scraped(1.0, 2.0, 0.0, 0.0)
    assert held.load(0.0, 3.0) == 3.0
    # A long conversation's next turn stays with the replica that holds the previous turn whole...
    assert policy.pick(prompt_blocks({"model": "m", "messages": talk}, ends), endpoints, 0.0)[0] is held
    # ...a new one, whose only match there is the shared system prompt, goes where there is no queue.
    fresh = [system, {"role": "user", "content": "hello " * 60}]
    assert policy.pick(prompt_blocks({"model": "m", "messages": fresh}, ends), endpoints, 0.0)[0] is idle
    for endpoint in endpoints:
        await endpoint.aclose()


async def test_prefix_forgets_an_endpoint_gone_from_the_backend_and_reuses_its_bit() -> None:
    endpoints = [Endpoint(f"http://10.0.0.{i}:8000/v1", LIMITS, None, False) for i in range(3)]
    policy = Prefix(RoutingSettings(policy="prefix", cache_blocks=4), 3.0)
    ends = block_ends(512, 32)
    keys = [prompt_blocks(chat(f"{n} " * 1500), ends) for n in range(3)]
    for key, endpoint in zip(keys, endpoints, strict=True):
        policy.served(key, endpoint, 0.0)
    assert [len(e.seen) for e in endpoints] == [4, 4, 4]  # the LRU's capacity, in blocks
    assert policy.pick(keys[2], endpoints, 0.0)[0] is endpoints[2]
    gone = endpoints.pop()
    bit = gone.bit
    policy.pick(keys[0], endpoints, 1000.0)  # a sweep: it has not been offered for longer than the TTL
    assert gone.bit == 0
    assert not gone.seen
    assert all(not mask & bit for mask in policy.where.values())
    newcomer = Endpoint("http://10.0.0.9:8000/v1", LIMITS, None, False)
    policy.served(keys[2], newcomer, 1000.0)
    assert newcomer.bit == bit
    for endpoint in [*endpoints, gone, newcomer]:
        await endpoint.aclose()


async def test_discovery_adds_warm_endpoints_and_drains_removed_ones() -> None:
    with ScriptedUpstream() as up:
        answers = [["127.0.0.1"], ["127.0.0.1", "127.0.0.2"], ["127.0.0.2"], []]

        async def resolver(host: str, port: int) -> list[str]:
            assert (host, port) == ("replicas.example", up.port)
            return answers.pop(0)

        backend = OpenAIBackend(type="openai", discovery={"dns": "replicas.example", "port": up.port})
        endpoints = Endpoints("b", backend, LIMITS, None, Health("b"), resolver=resolver)
        await endpoints.start()
        try:
            assert [e.label for e in endpoints.all] == [f"127.0.0.1:{up.port}"]
            assert endpoints.health.state == "up"
            assert endpoints.all[0].pool is not None
            assert endpoints.all[0].pool.idle == 1
            await endpoints.refresh()
            assert [e.label for e in endpoints.all] == [f"127.0.0.1:{up.port}", f"127.0.0.2:{up.port}"]
            first = endpoints.all[0]
            await endpoints.refresh()
            assert [e.label for e in endpoints.all] == [f"127.0.0.2:{up.port}"]
            assert first not in endpoints.live
            assert first.pool is not None
            deadline = time.monotonic() + 5
            while first.pool.size and time.monotonic() < deadline:  # noqa: ASYNC110 - drained, then closed
                await asyncio.sleep(0.01)
            assert first.pool.size == 0
            await endpoints.refresh()  # no addresses: the last known set is kept
            assert [e.label for e in endpoints.all] == [f"127.0.0.2:{up.port}"]
        finally:
            await endpoints.aclose()


async def test_outlier_ejection_never_takes_the_last_healthy_endpoint() -> None:
    backend = OpenAIBackend(
        type="openai",
        endpoints=["http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1", "http://127.0.0.1:11/v1"],
        outlier={"consecutive_failures": 2, "max_ejected_percent": 100},
    )
    endpoints = Endpoints("b", backend, PoolLimits(warm=0), None, Health("b"))
    await endpoints.start()
    try:
        now = time.monotonic()
        for endpoint in endpoints.all:
            endpoints.failed(endpoint, "test", now)
            endpoints.failed(endpoint, "test", now)
        assert [e.ejected_until > now for e in endpoints.all] == [True, True, False]
        assert endpoints.live == [endpoints.all[2]]
        # The back-off doubles while it keeps failing; a probe's success returns it.
        first = endpoints.all[0]
        assert first.ejected_until - now == 1.0
        endpoints._relive(now + 1.5)
        assert first.probing
        assert first in endpoints.live
        endpoints.failed(first, "test", now + 1.5)
        assert first.ejected_until - (now + 1.5) == 2.0
        endpoints._relive(now + 4.0)
        endpoints.succeeded(first)
        assert not first.probing
        assert first.ejections == 0
    finally:
        await endpoints.aclose()


def test_the_routing_bench_is_a_scenario_of_its_own() -> None:
    from tools.bench import command as bench

    assert bench.scenario_names("core,routing") == ("core", "routing")
    assert "routing" not in bench.scenario_names("all")  # it needs its own replicas and minutes


def test_an_anthropic_system_prompt_is_part_of_the_prefix() -> None:
    ends = block_ends(256, 8)
    system = "You are a coding agent. " * 40
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    anthropic = prompt_blocks({"model": "m", "system": system, "messages": messages}, ends)
    chat_form = prompt_blocks({"model": "m", "messages": [{"role": "system", "content": system}, *messages]}, ends)
    assert anthropic == chat_form
    assert prompt_blocks({"model": "m", "messages": messages}, ends) != anthropic


def test_sessions_are_found_in_agent_clients_own_headers_and_metadata() -> None:
    from gateway.context import Exchange

    policy = Session("x-my-session", 3.0)

    def key(headers: list[tuple[bytes, bytes]], body: dict[str, Any]) -> bytes | None:
        return policy.key(Exchange("r", "messages", headers, b"", {"model": "m", **body}, 0.0))

    assert key([(b"x-my-session", b"a"), (b"x-claude-code-session-id", b"b")], {}) == b"a"
    assert key([(b"x-claude-code-session-id", b"b")], {"user": "u"}) == b"b"
    assert key([(b"x-session-id", b"c")], {}) == b"c"
    assert key([(b"session_id", b"codex-1"), (b"x-session-id", b"c")], {}) == b"codex-1"  # the Codex CLI's
    assert key([], {"prompt_cache_key": "conv-1", "user": "u"}) == b"conv-1"
    assert key([], {"user": "u"}) == b"u"
    assert key([], {"metadata": {"user_id": "user_1_session_2"}}) == b"user_1_session_2"
    assert key([], {}) is None
