"""Anthropic's Messages API passed through `sluice serve` to a real llama-server, with the `anthropic` SDK.

llama.cpp serves `/v1/messages` itself, so the gateway forwards the client's body (its `cache_control` marks
included) and relays the stream. What is asserted is the server's own account: its usage, including
`cache_read_input_tokens` (its prompt cache reused on the second turn, as it is when asked directly), and the
gateway's token counters, which must add the prompt of message_start to the output of message_delta.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests.support.gateway import RunningGateway, gateway_process
from tests.support.llamacpp import gateway_metric, start_servers, wait_for
from tools.llamacpp import build as llamacpp
from tools.llamacpp.server import LlamaServer

SYSTEM: Any = [
    {
        "type": "text",
        "text": "A sluice is a water channel controlled by a gate. " * 12,
        "cache_control": {"type": "ephemeral"},
    }
]


@pytest.fixture(scope="module")
def llama(
    llama_build: llamacpp.Build, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    with ExitStack() as stack:
        (server,) = start_servers(stack, llama_build, tiny_model, tmp_path_factory.mktemp("llama"), slots=1)
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


def sdk(url: str) -> Any:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)


def prompt(usage: Any) -> int:
    return int(usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0))


def test_turns_reuse_the_servers_prompt_cache(gateway: RunningGateway, llama: LlamaServer) -> None:
    messages: Any = [{"role": "user", "content": "What is a sluice?"}]
    first = sdk(gateway.url).messages.create(model="tiny", max_tokens=4, system=SYSTEM, messages=messages)
    second = sdk(gateway.url).messages.create(model="tiny", max_tokens=4, system=SYSTEM, messages=messages)
    assert first.stop_reason == "max_tokens"
    assert first.usage.output_tokens == 4
    assert prompt(first.usage) == prompt(second.usage) > 100
    # The same prompt again: all but the last token read from the server's cache, through the gateway.
    assert second.usage.cache_read_input_tokens >= prompt(second.usage) - 2
    # Directly, the server counts the same prompt the same way: nothing was added or reordered on the way.
    direct = sdk(llama.base_url.removesuffix("/v1")).messages.count_tokens(
        model="tiny", system=SYSTEM, messages=messages
    )
    through = sdk(gateway.url).messages.count_tokens(model="tiny", system=SYSTEM, messages=messages)
    assert through.input_tokens == direct.input_tokens == prompt(first.usage)


def test_a_stream_through_the_gateway(gateway: RunningGateway) -> None:
    before_in = gateway_metric(gateway.url, "sluice_tokens_total", direction="input")
    before_out = gateway_metric(gateway.url, "sluice_tokens_total", direction="output")
    messages: Any = [{"role": "user", "content": "Tell me about gates."}]
    with sdk(gateway.url).messages.stream(model="tiny", max_tokens=6, system=SYSTEM, messages=messages) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert kinds[0] == "message_start"
    assert kinds[-1] == "message_stop"
    assert message.usage.output_tokens == 6
    # The gateway's account: the prompt from message_start, the output from message_delta.
    wait_for(lambda: gateway_metric(gateway.url, "sluice_tokens_total", direction="output") == before_out + 6)
    assert gateway_metric(gateway.url, "sluice_tokens_total", direction="input") == before_in + prompt(message.usage)
