"""The Codex CLI through the gateway to a real llama-server, over the Responses WebSocket: llama.cpp has no WebSocket
mode, so each of Codex's turns is bridged to `POST /v1/responses` on the server. The model is random: its answer is
gibberish, cut at `-n` tokens; what is asserted is that Codex finishes over the socket, with no retry or fallback."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest

from plugins.auth.keys import new_key
from tests.integration.gateway.test_codex import run_codex
from tests.support.codex import codex_home, codex_or_skip
from tests.support.gateway import gateway_process
from tests.support.llamacpp import model_or_skip, start_servers
from tests.support.wait import wait_until
from tools.llamacpp import build as llamacpp
from tools.llamacpp.model import LONG

KEY, KEY_HASH = new_key()


@pytest.fixture(scope="module")
def codex() -> Path:
    return codex_or_skip()


@pytest.fixture(scope="module")
def long_model(llama_build: llamacpp.Build) -> Path:
    return model_or_skip(llama_build, LONG)  # Codex's first prompt is about 5,000 tokens


def test_codex_exec_over_the_websocket_on_llama_server(
    codex: Path, llama_build: llamacpp.Build, long_model: Path, tmp_path: Path
) -> None:
    with ExitStack() as stack:
        # Its answer is cut at 16 tokens: the random model never ends one itself.
        (llama,) = start_servers(stack, llama_build, long_model, tmp_path, context=8192, extra=("-n", "16"))
        config = f"""
backends:
  llama: {{type: llamacpp, base_url: "{llama.base_url}"}}
models:
  tiny: {{backend: llama}}
tenants:
  acme: {{keys: ["{KEY_HASH}"]}}
plugins: [auth]
"""
        gw = stack.enter_context(gateway_process(config, tmp_path, "--access-log", "--log-level", "info"))
        home = codex_home(tmp_path / "codex", gw.base_url, "tiny")
        run_codex(codex, home, tmp_path, "login", "--with-api-key", stdin=KEY)
        output = run_codex(codex, home, tmp_path, "exec", "--skip-git-repo-check", "Say ok")
        assert "Reconnecting" not in output
        assert "Falling back" not in output
        assert "tokens used" in output

        def turns() -> list[str]:
            return [line for line in gw.log_text().splitlines() if "sluice.access: responses 200" in line]

        lines = wait_until(turns, 20, what="the turn's access line")
        assert all("sluice.transport=websocket" in line for line in lines)
