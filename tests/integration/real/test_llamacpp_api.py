"""A real llama-server behind `sluice serve` (`type: llamacpp`), through the official openai SDK.

What is asserted is the server's own account: `timings` (`prompt_n`, `cache_n`, `predicted_n`), `usage` with
`prompt_tokens_details.cached_tokens`, its `/metrics` and `/slots`, set against what the gateway relays and
counts. The model is random (its text is gibberish and rarely ends early), so completions run to `max_tokens`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.gateway import RunningGateway, gateway_process
from tests.support.llamacpp import gateway_metric, start_servers, wait_for
from tools.llamacpp import build as llamacpp
from tools.llamacpp.server import LlamaServer

SLOTS = 2
PROMPT = "A sluice is a water channel controlled at its head by a gate. " * 12
MESSAGES: Any = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def llama(
    llama_build: llamacpp.Build, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    with ExitStack() as stack:
        (server,) = start_servers(stack, llama_build, tiny_model, tmp_path_factory.mktemp("llama"), slots=SLOTS)
        yield server


@pytest.fixture(scope="module")
def gateway(llama: LlamaServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    config = f"""
backends:
  llama: {{type: llamacpp, base_url: "{llama.base_url}"}}
pool: {{warm_connections: 1}}
models:
  tiny: {{backend: llama}}
"""
    with gateway_process(config, tmp_path_factory.mktemp("gateway")) as gw:
        yield gw


def sdk(gw: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0)


def timings(body: Any) -> dict[str, Any]:
    """llama.cpp's own `timings` object, which the gateway relays untouched."""
    extra = body.model_extra or {}
    found: dict[str, Any] = extra["timings"]
    return found


def tokens_counted(gw: RunningGateway, direction: str) -> float:
    return gateway_metric(gw.url, "sluice_tokens_total", model="tiny", direction=direction)


def settled(gw: RunningGateway, llama: LlamaServer) -> float:
    """The output tokens the gateway counted, once they are all the server generated: the gateway is the
    server's only client and counts a response's usage after its last byte, so an earlier test's may be late."""
    counted: list[float] = []

    def equal() -> bool:
        counted[:] = [tokens_counted(gw, "output")]
        return counted[0] == llama.metrics()["tokens_predicted_total"]

    wait_for(equal, what="the gateway's output tokens equal to the server's")
    return counted[0]


def test_chat_not_streamed_reports_the_servers_timings_and_its_prompt_cache(
    gateway: RunningGateway, llama: LlamaServer
) -> None:
    messages: Any = [*MESSAGES[:1], {"role": "user", "content": f"first: {PROMPT}"}]
    before = llama.metrics()
    first = sdk(gateway).chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert first.choices[0].finish_reason == "length"
    assert first.usage is not None
    assert first.usage.completion_tokens == 8
    spent = timings(first)
    assert spent["predicted_n"] == 8
    # Every prompt token was either evaluated or taken from the cache; this prompt was new, so nearly all were
    # evaluated (the chat template's opening tokens may already sit in a slot from an earlier request).
    assert spent["prompt_n"] + spent["cache_n"] == first.usage.prompt_tokens
    assert spent["prompt_n"] > first.usage.prompt_tokens / 2
    after = llama.metrics()
    assert after["tokens_predicted_total"] - before["tokens_predicted_total"] == 8
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == spent["prompt_n"]

    again = sdk(gateway).chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert again.usage is not None
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    details = again.usage.prompt_tokens_details
    assert details is not None
    assert details.cached_tokens is not None
    # The same prompt again: all of it but the last token comes from the slot's cache.
    assert details.cached_tokens == timings(again)["cache_n"]
    assert details.cached_tokens >= again.usage.prompt_tokens - 2
    assert timings(again)["prompt_n"] <= 2
    slots = llama.slot_states()
    assert len(slots) == SLOTS
    assert {slot["n_ctx"] for slot in slots} == {llama.context}
    assert not any(slot["is_processing"] for slot in slots)


def test_chat_streamed_with_usage_ends_with_the_servers_usage_chunk(gateway: RunningGateway) -> None:
    stream = sdk(gateway).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == 12
    assert timings(last)["predicted_n"] == 12
    # One chunk per token, except where a token is part of a character and waits for the next one.
    assert 1 <= len(content) <= 12
    assert [c for c in chunks if c.usage is not None] == [last]


def test_a_stream_without_usage_shows_none_yet_the_gateway_counts_its_tokens(
    gateway: RunningGateway, llama: LlamaServer
) -> None:
    output, prompt = settled(gateway, llama), tokens_counted(gateway, "input")
    before = llama.metrics()
    stream = sdk(gateway).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, stream=True)
    chunks = list(stream)
    assert chunks
    assert all(c.usage is None for c in chunks)  # the gateway asked for usage upstream, the client did not
    assert all(c.choices for c in chunks)  # nor does it see the usage chunk's empty `choices`
    assert settled(gateway, llama) - output == 10
    assert llama.metrics()["tokens_predicted_total"] - before["tokens_predicted_total"] == 10
    assert tokens_counted(gateway, "input") - prompt > 100  # the whole prompt, cached tokens included


@pytest.mark.parametrize("stream", [False, True])
def test_completions_streamed_and_not(gateway: RunningGateway, llama: LlamaServer, stream: bool) -> None:
    output = settled(gateway, llama)
    before = llama.metrics()
    prompt = f"{'streamed' if stream else 'whole'}: {PROMPT}"
    if stream:
        chunks = list(
            sdk(gateway).completions.create(
                model="tiny", prompt=prompt, max_tokens=7, stream=True, stream_options={"include_usage": True}
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert [c for c in chunks if c.usage is not None] == [chunks[-1]]
    else:
        whole = sdk(gateway).completions.create(model="tiny", prompt=prompt, max_tokens=7)
        text, usage = whole.choices[0].text, whole.usage
        assert whole.choices[0].finish_reason == "length"
        assert timings(whole)["predicted_n"] == 7
    assert text
    assert usage is not None
    assert usage.completion_tokens == 7
    assert usage.prompt_tokens > 100
    assert llama.metrics()["tokens_predicted_total"] - before["tokens_predicted_total"] == 7
    assert settled(gateway, llama) - output == 7


def test_n_up_to_the_slot_count_is_served(gateway: RunningGateway) -> None:
    whole = sdk(gateway).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, n=SLOTS)
    assert sorted(choice.index for choice in whole.choices) == list(range(SLOTS))
    stream = sdk(gateway).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, n=SLOTS, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert {c.choices[0].index for c in chunks if c.choices} == set(range(SLOTS))
    assert chunks[-1].usage is not None
    # Above the slot count the server's own 400 names the bound.
    with pytest.raises(openai.BadRequestError):
        sdk(gateway).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, n=SLOTS + 1)
