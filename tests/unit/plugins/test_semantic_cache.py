"""The semantic cache's parts on their own: what a request is looked up by, the in-process store, the wire forms."""

from __future__ import annotations

import base64
import importlib.util
import time
from typing import Any

import numpy as np
import orjson
import pytest

from gateway.config import parse as parse_config
from gateway.context import Exchange
from gateway.server import request
from gateway.settings import ConfigError
from plugins.semantic_cache import SemanticCache
from plugins.semantic_cache.embedder import EmbedFailed, parse
from plugins.semantic_cache.key import Lookup, Rules, plan
from plugins.semantic_cache.memory import MemoryStore
from plugins.semantic_cache.pgvector import decode_vector, encode_vector
from plugins.semantic_cache.store import Entry, Where
from plugins.semantic_cache.verifier import agrees, question

RULES = Rules(embedding_model="minilm", embed="last_user", max_temperature=1.0, allow_tools=False, max_text_chars=200)
ASK = [{"role": "user", "content": "How do I reverse a list in Python?"}]


def exchange(endpoint: str = "chat/completions", **body: Any) -> Exchange:
    fields = {"model": "chat", "messages": ASK, **body}
    if endpoint == "completions":
        fields.pop("messages")
    return request.parse(endpoint, [], orjson.dumps(fields), time.perf_counter(), "r1")


def lookup(ex: Exchange, rules: Rules = RULES) -> Lookup:
    found = plan(ex, rules)
    assert isinstance(found, Lookup), found
    return found


def test_the_last_user_message_is_embedded_and_the_rest_is_the_partition() -> None:
    plain = lookup(exchange(temperature=0))
    assert plain.text == "How do I reverse a list in Python?"
    # Another wording of the question: another text, the same partition.
    other = lookup(exchange(temperature=0, messages=[{"role": "user", "content": "Reverse a Python list?"}]))
    assert other.partition == plain.partition
    # Transport-only fields do not move the partition.
    assert lookup(exchange(temperature=0, stream=True, user="u1", metadata={"a": "b"})).partition == plain.partition
    assert lookup(exchange(temperature=0, prompt_cache_key="conv-1")).partition == plain.partition


@pytest.mark.parametrize(
    "change",
    [
        {"messages": [{"role": "system", "content": "Answer in French."}, *ASK]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, *ASK]},
        {"temperature": 0.5},
        {"max_tokens": 20},
        {"seed": 7},
        {"response_format": {"type": "json_object"}},
    ],
    ids=["system-prompt", "earlier-turns", "temperature", "max-tokens", "seed", "response-format"],
)
def test_whatever_changes_the_answer_changes_the_partition(change: dict[str, Any]) -> None:
    assert lookup(exchange(**{"temperature": 0, **change})).partition != lookup(exchange(temperature=0)).partition


def test_the_embedding_model_is_part_of_the_partition() -> None:
    other = Rules("another-embedder", "last_user", 1.0, False, 200)
    assert lookup(exchange(), other).partition != lookup(exchange()).partition


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"n": 2}, "n"),
        ({"temperature": 1.5}, "temperature"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"messages": [*ASK, {"role": "assistant", "content": "Sure,"}]}, "input"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "input"),
        ({"messages": [{"role": "user", "content": "x" * 201}]}, "length"),
    ],
    ids=["n", "temperature", "tools", "assistant-last", "image", "too-long"],
)
def test_requests_that_are_not_eligible_say_why(body: dict[str, Any], why: str) -> None:
    assert plan(exchange(**body), RULES) == why


def test_no_temperature_counts_as_the_apis_default_of_one() -> None:
    assert isinstance(plan(exchange(), RULES), Lookup)
    strict = Rules("minilm", "last_user", 0.5, False, 200)
    assert plan(exchange(), strict) == "temperature"
    assert isinstance(plan(exchange(temperature=0.2), strict), Lookup)


def test_tools_are_eligible_when_allowed_and_then_part_of_the_partition() -> None:
    rules = Rules("minilm", "last_user", 1.0, True, 200)
    one = lookup(exchange(tools=[{"type": "function", "function": {"name": "f"}}]), rules)
    two = lookup(exchange(tools=[{"type": "function", "function": {"name": "g"}}]), rules)
    assert one.partition != two.partition


def test_a_completion_prompt_is_embedded() -> None:
    found = lookup(exchange("completions", prompt="Once upon a time"))
    assert found.text == "Once upon a time"


def test_text_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "Reverse"}, {"type": "text", "text": "a list"}]
    assert lookup(exchange(messages=[{"role": "user", "content": parts}])).text == "Reverse\na list"


def responses(**body: Any) -> Exchange:
    fields = {"model": "chat", "input": "How do I reverse a list in Python?", **body}
    return request.parse("responses", [], orjson.dumps(fields), time.perf_counter(), "r1")


def test_a_responses_input_is_embedded_as_a_string_or_its_last_user_message() -> None:
    plain = lookup(responses(temperature=0))
    assert plain.text == "How do I reverse a list in Python?"
    parts = [{"type": "input_text", "text": "How do I reverse a list in Python?"}]
    listed = lookup(responses(temperature=0, input=[{"role": "user", "content": parts}]))
    assert listed.text == plain.text
    assert listed.partition == plain.partition  # a string input and a one-message list are the same request
    # Instructions, earlier items and `store` (a stored response can be read back by its id) are the partition.
    assert lookup(responses(temperature=0, instructions="Answer in French.")).partition != plain.partition
    earlier = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert lookup(responses(temperature=0, input=[*earlier, {"role": "user", "content": parts}])).partition != (
        plain.partition
    )
    assert lookup(responses(temperature=0, store=True)).partition != lookup(responses(temperature=0)).partition
    # And the endpoint: a chat request with the same question never shares its entries.
    assert lookup(exchange(temperature=0)).partition != plain.partition


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"background": True}, "background"),
        ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "42"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": "   "}, "input"),
    ],
    ids=["background", "tool-output-last", "image", "blank"],
)
def test_responses_that_are_not_eligible_say_why(body: dict[str, Any], why: str) -> None:
    assert plan(responses(**body), RULES) == why


# -- the in-process store


def unit(seed: int, dimensions: int = 8) -> np.ndarray[Any, np.dtype[np.float32]]:
    vector = np.random.default_rng(seed).standard_normal(dimensions).astype(np.float32)
    out: np.ndarray[Any, np.dtype[np.float32]] = vector / np.linalg.norm(vector)
    return out


def entry(where: Where, seed: int, ttl_s: float = 60.0, answer: bytes = b"{}") -> Entry:
    now = time.time()
    made = Entry(where, f"text {seed}", "chat/completions", "chat", answer, now, now + ttl_s)
    made.vector = unit(seed)
    return made


ACME = Where("acme", "chat", "p1")
GLOBEX = Where("globex", "chat", "p1")


async def test_a_search_finds_the_nearest_within_its_partition_only() -> None:
    store = MemoryStore(100, 10_000_000)
    for seed in range(10):
        await store.add(entry(ACME, seed))
    found = await store.search(ACME, unit(3), 3)
    assert found[0].entry.text == "text 3"
    assert found[0].similarity == pytest.approx(1.0, abs=1e-5)
    assert [c.similarity for c in found] == sorted((c.similarity for c in found), reverse=True)
    assert await store.search(GLOBEX, unit(3), 3) == []  # another tenant's partition holds nothing
    assert await store.search(Where("acme", "chat", "p2"), unit(3), 3) == []


async def test_expired_entries_are_never_returned_and_are_dropped() -> None:
    store = MemoryStore(100, 10_000_000)
    await store.add(entry(ACME, 1, ttl_s=-1.0))
    await store.add(entry(ACME, 2))
    found = await store.search(ACME, unit(1), 3)
    assert [c.entry.text for c in found] == ["text 2"]
    assert len(store) == 1


async def test_the_store_is_bounded_in_entries_and_bytes_oldest_first() -> None:
    store = MemoryStore(5, 10_000_000)
    for seed in range(8):
        await store.add(entry(ACME if seed % 2 else GLOBEX, seed))
    assert len(store) == 5
    assert {e.text for e in store.order.values()} == {f"text {s}" for s in range(3, 8)}
    sized = MemoryStore(1000, 3 * entry(ACME, 0, answer=b"x" * 1000).size)
    for seed in range(6):
        await sized.add(entry(ACME, seed, answer=b"x" * 1000))
    assert len(sized) == 3
    assert sized.bytes <= sized.max_bytes
    # What remains is still searchable after the swaps eviction made.
    for kept in sized.order.values():
        assert kept.vector is not None
        assert (await sized.search(ACME, kept.vector, 1))[0].entry is kept


async def test_purge_removes_one_tenants_entries() -> None:
    store = MemoryStore(100, 10_000_000)
    for seed in range(4):
        await store.add(entry(ACME, seed))
        await store.add(entry(GLOBEX, seed + 10))
    assert await store.purge("acme", None) == 4
    assert await store.search(ACME, unit(1), 3) == []
    assert len(await store.search(GLOBEX, unit(11), 3)) == 3


# -- wire forms


def test_an_embedding_is_read_as_floats_or_base64_and_made_unit_length() -> None:
    raw = [3.0, 4.0]
    floats = parse(orjson.dumps({"data": [{"embedding": raw}]}))
    packed = base64.b64encode(np.asarray(raw, dtype="<f4").tobytes()).decode()
    assert np.allclose(floats, [0.6, 0.8])
    assert np.allclose(parse(orjson.dumps({"data": [{"embedding": packed}]})), [0.6, 0.8])
    for bad in (b"not json", b'{"data": []}', b'{"data": [{"embedding": [0, 0]}]}'):
        with pytest.raises(EmbedFailed):
            parse(bad)


def test_pgvectors_binary_form_round_trips() -> None:
    vector = unit(5, 384)
    data = encode_vector(vector)
    assert len(data) == 4 + 384 * 4
    assert np.array_equal(decode_vector(data), vector)


# -- the config


BASE = """
backends:
  sim: {type: simulated}
models:
  chat: {backend: sim}
  embed: {backend: sim}
"""


def problems(text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(BASE + text, "<test>")
    return "\n".join(caught.value.lines)


def test_the_config_names_what_is_missing_or_wrong() -> None:
    assert "semantic_cache.embedding_model: required" in problems("plugins: [semantic_cache]\n")
    assert "no model named 'nope'" in problems("semantic_cache: {embedding_model: nope}\nplugins: [semantic_cache]\n")
    assert "store.dsn" in problems(
        "semantic_cache: {embedding_model: embed, store: {type: pgvector}}\nplugins: [semantic_cache]\n"
    )
    # After the exact cache, whose hit always wins.
    assert "'cache' must come before 'semantic_cache'" in problems(
        "semantic_cache: {embedding_model: embed}\nplugins: [semantic_cache, cache]\n"
    )


def test_typo_mending_without_its_package_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # As on a machine where the `semantic` extra was not installed: the module cannot be found.
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "spellchecker" else real(name, *a)
    )
    found = problems("semantic_cache: {embedding_model: embed}\nplugins: [semantic_cache]\n")
    assert "semantic_cache.spelling: needs pyspellchecker" in found
    assert "spelling: false" in found
    parse_config(BASE + "semantic_cache: {embedding_model: embed, spelling: false}\nplugins: [semantic_cache]\n", "<t>")


def test_a_verifier_must_name_a_model_of_the_config() -> None:
    def with_verifier(verifier: str) -> str:
        text = f"""
backends:
  sim: {{type: simulated}}
models:
  chat: {{backend: sim, semantic_cache: {{verifier: {verifier}}}}}
  embed: {{backend: sim}}
  judge: {{backend: sim}}
semantic_cache: {{embedding_model: embed}}
plugins: [semantic_cache]
"""
        with pytest.raises(ConfigError) as caught:
            parse_config(text, "<test>")
        return "\n".join(caught.value.lines)

    unknown = with_verifier("{model: nope}")
    assert unknown.count("\n") == 0  # one line
    assert "models.chat.semantic_cache.verifier.model: no model named 'nope' in models" in unknown
    assert "verifier.model" in with_verifier("{deadline_ms: 300}")
    assert "verifier.deadline_ms" in with_verifier("{model: judge, deadline_ms: 0}")


def test_a_verifier_is_off_unless_configured() -> None:
    text = BASE.replace(
        "chat: {backend: sim}", "chat: {backend: sim, semantic_cache: {verifier: {model: embed, deadline_ms: 250}}}"
    )
    settings = parse_config(text + "semantic_cache: {embedding_model: embed}\nplugins: [semantic_cache]\n", "<t>")
    plugin = SemanticCache(settings.plugin_config("semantic_cache"), settings)
    verifier = plugin.policies["chat"].verifier
    assert verifier is not None
    assert (verifier.model, verifier.deadline_ms) == ("embed", 250)
    plain = parse_config(BASE + "semantic_cache: {embedding_model: embed}\nplugins: [semantic_cache]\n", "<t>")
    assert SemanticCache(plain.plugin_config("semantic_cache"), plain).policies["chat"].verifier is None


def test_a_verifier_answer_is_a_clear_yes_or_not_agreement() -> None:
    def answer(content: object) -> dict[str, object]:
        return {"choices": [{"message": {"role": "assistant", "content": content}}]}

    assert agrees(answer("Yes"))
    assert agrees(answer(" yes."))
    refused: list[object] = [answer("No"), answer("maybe yes"), answer(None), answer(3), {}, [], None]
    assert not any(agrees(a) for a in refused)
    asked = question("judge", "Convert 5 km to miles", "Convert 5 miles to km")
    assert asked["model"] == "judge"
    assert asked["temperature"] == 0
    assert "Request A: Convert 5 km to miles\nRequest B: Convert 5 miles to km" in asked["messages"][0]["content"]


def test_a_valid_config_caches_every_model_but_the_embedding_model() -> None:
    text = BASE + "semantic_cache: {embedding_model: embed}\nplugins: [cache, semantic_cache]\n"
    settings = parse_config(text, "<test>")
    plugin = SemanticCache(settings.plugin_config("semantic_cache"), settings)
    assert set(plugin.policies) == {"chat"}
    assert plugin.policies["chat"].threshold == 0.80
    assert plugin.policies["chat"].deadline_s == 0.1


async def test_a_partition_is_bounded_on_its_own_oldest_first() -> None:
    store = MemoryStore(100, 10_000_000, max_partition_entries=3)
    for seed in range(5):
        await store.add(entry(ACME, seed))
    await store.add(entry(GLOBEX, 9))
    assert sorted(e.text for e in store.partitions[ACME].entries) == ["text 2", "text 3", "text 4"]
    assert len(store) == 4  # the other partition is untouched
