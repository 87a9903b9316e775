"""The Responses API's WebSocket mode bridged to a real llama-server, which has no such mode: each turn is a
Responses request to `/v1/responses`, its history expanded from the socket's memory (the server keeps nothing)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.gateway import RunningGateway, gateway_process
from tests.support.llamacpp import start_servers
from tools.llamacpp import build as llamacpp
from tools.llamacpp.server import LlamaServer

PROMPT = "A sluice is a water channel controlled at its head by a gate. " * 8


@pytest.fixture()
def llama(llama_build: llamacpp.Build, tiny_model: Path, tmp_path: Path) -> Iterator[LlamaServer]:
    with ExitStack() as stack:
        (server,) = start_servers(stack, llama_build, tiny_model, tmp_path, slots=1)
        yield server


@pytest.fixture()
def gateway(llama: LlamaServer, tmp_path: Path) -> Iterator[RunningGateway]:
    config = f"""
backends:
  llama: {{type: llamacpp, base_url: "{llama.base_url}"}}
pool: {{warm_connections: 1}}
models:
  tiny: {{backend: llama}}
"""
    with gateway_process(config, tmp_path, "--access-log", "--log-level", "info") as gw:
        yield gw


def turn(conn: Any) -> Any:
    for event in conn:
        if event.type in ("response.completed", "response.incomplete", "response.failed", "error"):
            return event
    raise AssertionError("the socket closed before the turn ended")


def test_a_conversation_continues_over_the_socket_on_llama_server(gateway: RunningGateway) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
    with client.responses.connect() as conn:
        conn.send({"type": "response.create", "model": "tiny", "input": PROMPT, "max_output_tokens": 4, "store": False})
        first = turn(conn)
        assert first.type in ("response.completed", "response.incomplete"), first
        conn.send(
            {
                "type": "response.create",
                "model": "tiny",
                "input": "And a weir?",
                "previous_response_id": first.response.id,
                "max_output_tokens": 4,
                "store": False,
            }
        )
        second = turn(conn)
    assert second.type in ("response.completed", "response.incomplete"), second
    # The server saw the whole conversation: the first prompt and answer, then the new question.
    assert second.response.usage.input_tokens > first.response.usage.input_tokens + 2
    # And it started from the first turn's prompt, which its cache still held: that prefix was not computed again.
    assert (second.response.usage.input_tokens_details.cached_tokens or 0) >= first.response.usage.input_tokens // 2
    lines = [line for line in gateway.log_text().splitlines() if "sluice.access: responses 200" in line]
    assert len(lines) == 2
    assert all("sluice.transport=websocket" in line for line in lines)
