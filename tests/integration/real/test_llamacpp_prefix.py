"""Prefix routing over real llama-server replicas: does a conversation's next turn find its prompt cached?

Each replica is started with its own `--alias`, which llama-server puts in every response's `model`, so a
response says which replica served it. Whether the prefix was there is the server's own account:
`usage.prompt_tokens_details.cached_tokens` (and `timings.cache_n`). The same conversations go through a
`prefix` backend and a `round_robin` one, each with its own replicas, in the same run, interleaved: their cached
shares are compared, and so are their TTFTs (as a ratio, since the machine's speed swings).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateway import gateway_process
from tests.support.llamacpp import Start, model_or_skip
from tools.llamacpp import build as llamacpp
from tools.llamacpp.model import LONG
from tools.llamacpp.server import LlamaServer

REPLICAS = 3
TURNS = 4
_WORDS = [
    "gate",
    "channel",
    "river",
    "mill",
    "wheel",
    "flow",
    "level",
    "water",
    "stone",
    "bank",
    "lock",
    "weir",
    "dam",
    "reach",
    "race",
    "pond",
]


def system_prompt(topic: int, sentences: int) -> str:
    """A distinct, deterministic system prompt of about 12 tokens a sentence."""
    return " ".join(
        f"Rule {topic}.{i}: the {_WORDS[(topic + i) % len(_WORDS)]} near the {_WORDS[(3 * i + topic) % len(_WORDS)]} "
        f"stays {_WORDS[(7 * i) % len(_WORDS)]}."
        for i in range(sentences)
    )


@dataclass
class Conversation:
    number: int
    messages: list[Any]  # the chat so far, as sent
    replicas: list[str] = field(default_factory=list)  # the alias that served each turn
    cached: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)


def conversations(lengths: tuple[int, ...]) -> list[Conversation]:
    """One conversation per length (in sentences of its system prompt); a length given twice is one system
    prompt that two conversations share."""
    found: list[Conversation] = []
    for sentences in lengths:
        system = system_prompt(sentences, sentences)
        found.append(Conversation(len(found), [{"role": "system", "content": system}]))
    return found


def say(sdk: openai.OpenAI, model: str, talk: Conversation, turn: int) -> None:
    """One turn, streamed: its TTFT, which replica answered, how much of its prompt was cached."""
    talk.messages.append({"role": "user", "content": f"Conversation {talk.number}, turn {turn}: what of the gate?"})
    started = time.monotonic()
    stream = sdk.chat.completions.create(
        model=model,
        messages=talk.messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, first, usage, served = [], None, None, ""
    for chunk in stream:
        served = chunk.model
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.monotonic()
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None
    assert usage.prompt_tokens_details is not None
    talk.messages.append({"role": "assistant", "content": "".join(text)})
    talk.replicas.append(served)
    talk.cached.append(usage.prompt_tokens_details.cached_tokens or 0)
    talk.prompt.append(usage.prompt_tokens)
    talk.ttft.append((first or time.monotonic()) - started)


def gateway_config(pre: list[LlamaServer], rr: list[LlamaServer], routing: str = "prefix") -> str:
    def urls(servers: list[LlamaServer]) -> str:
        return ", ".join(f'"{server.base_url}"' for server in servers)

    return f"""
backends:
  pre: {{type: llamacpp, endpoints: [{urls(pre)}], routing: {routing}}}
  rr: {{type: llamacpp, endpoints: [{urls(rr)}], routing: round_robin}}
pool: {{warm_connections: 1}}
models:
  pre: {{backend: pre}}
  rr: {{backend: rr}}
"""


def replicas(start: Start, name: str, count: int = REPLICAS, **options: Any) -> list[LlamaServer]:
    servers = [start(1, ready=False, alias=f"{name}{i}", threads=1, slots=2, **options)[0] for i in range(count)]
    for server in servers:
        server.wait_ready()
    return servers


def tokens(server: LlamaServer, text: str) -> int:
    """How many tokens the server makes of `text` (its /tokenize), less a few for the template's seams."""
    found: list[int] = httpx.post(f"{server.url}/tokenize", json={"content": text}).json()["tokens"]
    return len(found) - 4


def warm(server: LlamaServer, system: str) -> None:
    body = {"messages": [{"role": "system", "content": system}], "max_tokens": 1}
    httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=300).raise_for_status()


def later_share(talks: list[Conversation]) -> float:
    """Of the prompt tokens of every turn after the first, the share the servers had cached."""
    cached = sum(sum(talk.cached[1:]) for talk in talks)
    return cached / sum(sum(talk.prompt[1:]) for talk in talks)


def test_prefix_routing_keeps_each_conversation_on_the_replica_holding_its_prompt(
    llama_servers: Start, tmp_path: Path
) -> None:
    pre, rr = replicas(llama_servers, "pre"), replicas(llama_servers, "rr")
    # System prompts of about 200, 630, 1,100 and 1,900 tokens, all but one shared by two conversations: seven
    # conversations (so that round_robin moves each one at every turn) over three replicas of two slots.
    lengths = (10, 10, 40, 40, 120, 120, 60)
    by_prefix, by_turn = conversations(lengths), conversations(lengths)
    with gateway_process(gateway_config(pre, rr), tmp_path) as gw:
        client = openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0)
        for turn in range(TURNS):
            for a, b in zip(by_prefix, by_turn, strict=True):  # interleaved: both see the same machine
                say(client, "pre", a, turn)
                say(client, "rr", b, turn)
    # Under prefix, no conversation moved, and each later turn found at least its system prompt cached (with
    # two conversations on one system prompt, llama.cpp gives both the slot that holds it, so one's own
    # earlier turns may be gone; alone, it finds all of them).
    for talk in by_prefix:
        assert len(set(talk.replicas)) == 1, f"conversation {talk.number} moved: {talk.replicas}"
        system = tokens(pre[0], talk.messages[0]["content"])
        assert all(cached >= system for cached in talk.cached[1:]), (talk.number, system, talk.cached)
    alone = by_prefix[-1]
    assert all(alone.cached[turn] >= alone.prompt[turn - 1] for turn in range(1, TURNS)), (alone.cached, alone.prompt)
    # Different system prompts were spread over the replicas; round_robin moved every conversation every turn.
    assert len({talk.replicas[0] for talk in by_prefix}) >= 2
    assert all(len(set(talk.replicas)) == min(TURNS, REPLICAS) for talk in by_turn), [t.replicas for t in by_turn]
    prefix_share, turn_share = later_share(by_prefix), later_share(by_turn)
    assert prefix_share > 0.85, prefix_share
    assert prefix_share > turn_share + 0.1, (prefix_share, turn_share)
    for servers, talks in ((pre, by_prefix), (rr, by_turn)):
        counted = sum(server.metrics()["prompt_tokens_total"] for server in servers)
        evaluated = sum(sum(talk.prompt) - sum(talk.cached) for talk in talks)
        assert counted == pytest.approx(evaluated, rel=0.05, abs=TURNS * len(talks) * 2)
    # Less prefill, less waiting for first tokens: the later turns' TTFTs added up, compared within one run
    # (absolute times swing with the machine; the sum is led by the misses, which cost seconds).
    prefix_wait = sum(t for talk in by_prefix for t in talk.ttft[1:])
    turn_wait = sum(t for talk in by_turn for t in talk.ttft[1:])
    assert prefix_wait < turn_wait, (prefix_wait, turn_wait)


def test_conversations_sharing_a_system_prompt_over_16_kib_keep_their_replica(
    llama_servers: Start, llama_build: llamacpp.Build, tmp_path: Path
) -> None:
    long_model = model_or_skip(llama_build, LONG)
    # About 5,800 tokens (17 KiB): longer than the 16 KiB of leading blocks the prefix key hashes by default, so
    # that only the conversation's own mark tells the replicas apart.
    system = system_prompt(7, 360)
    assert len(system) > 16 * 1024
    servers = replicas(llama_servers, "long", count=2, context=8192, model=long_model)
    # Each replica evaluates the system prompt once, straight, beforehand: later its two slots take it from
    # there, rather than both evaluating ~5,800 tokens at once on one thread.
    with ThreadPoolExecutor(len(servers)) as pool:
        list(pool.map(lambda server: warm(server, system), servers))
    talks = [Conversation(n, [{"role": "system", "content": system}]) for n in range(2 * len(servers))]
    config = gateway_config(servers, servers[:1], routing="{policy: prefix, max_load_factor: 1.25}")
    with gateway_process(config, tmp_path) as gw:
        client = openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=300)
        # The first turns all at once: bounded load spreads them over the replicas, two a replica. Each opens
        # with a question of its own, longer than two of the key's blocks, so that the conversations differ
        # by whole blocks.
        for talk in talks:
            talk.messages.append({"role": "user", "content": system_prompt(talk.number + 20, 24)})
        with ThreadPoolExecutor(len(talks)) as pool:
            list(pool.map(lambda talk: say(client, "pre", talk, 0), talks))
        # The later turns one at a time, no load anywhere: each should go back to the replica that holds its
        # conversation, the longest match.
        for turn in range(1, 3):
            for talk in talks:
                say(client, "pre", talk, turn)
                assert len(set(talk.replicas)) == 1, f"turn {turn}: conversation {talk.number} moved: {talk.replicas}"
    assert len({talk.replicas[0] for talk in talks}) == len(servers)
