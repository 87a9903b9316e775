"""The OpenAI Codex CLI (npm `@openai/codex`) through `sluice serve`: its built-in OpenAI provider pointed at the
gateway with `openai_base_url` opens the Responses WebSocket first, and must finish over it, with no retries
and no fallback to HTTP."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

from plugins.auth.keys import new_key
from tests.support.codex import codex_home, codex_or_skip
from tests.support.gateway import gateway_process
from tests.support.openai_socket import FakeOpenAI
from tests.support.wait import wait_until

KEY, KEY_HASH = new_key()
RUN_TIMEOUT_S = 180

CONFIG = f"""
backends:
  sim: {{type: simulated, ttft_ms: 50, tpot_ms: 5}}
models:
  chat-large: {{backend: sim, upstream_model: large}}
tenants:
  acme: {{keys: ["{KEY_HASH}"]}}
plugins: [auth, rate_limit]
"""


@pytest.fixture(scope="session")
def codex() -> Path:
    return codex_or_skip()


def run_codex(codex: Path, home: Path, workdir: Path, *args: str, stdin: str | None = None) -> str:
    env = {**os.environ, "CODEX_HOME": str(home), "NO_COLOR": "1"}
    env.pop("OPENAI_API_KEY", None)
    done = subprocess.run(
        [str(codex), *args],
        cwd=workdir,
        env=env,
        input=stdin.encode() if stdin is not None else b"",
        capture_output=True,
        timeout=RUN_TIMEOUT_S,
    )
    output = (done.stdout + done.stderr).decode(errors="replace")
    assert done.returncode == 0, output
    return output


def test_codex_exec_runs_its_turns_over_the_websocket(codex: Path, tmp_path: Path) -> None:
    with gateway_process(CONFIG, tmp_path, "--access-log", "--log-level", "info") as gw:
        home = codex_home(tmp_path / "codex", gw.base_url, "chat-large")
        # The built-in OpenAI provider takes its key from its own login, as a user would store it.
        run_codex(codex, home, tmp_path, "login", "--with-api-key", stdin=KEY)
        output = run_codex(codex, home, tmp_path, "exec", "--skip-git-repo-check", "Say ok")
        assert "Reconnecting" not in output
        assert "Falling back" not in output
        assert "HTTPS transport" not in output
        assert "tokens used" in output  # it finished a turn

        def turns() -> list[str]:
            return [line for line in gw.log_text().splitlines() if "sluice.access: responses 200" in line]

        lines = wait_until(turns, 20, what="the turn's access line")
        # Every answer went over the socket (an HTTP create's line has no sluice.transport), for the key's tenant.
        assert all("sluice.transport=websocket" in line and "tenant=acme" in line for line in lines)
        assert "(websocket) 4" not in gw.log_text()  # no refused upgrade
        metrics = httpx.get(f"{gw.url}/metrics", timeout=10).text
        counted = [
            line for line in metrics.splitlines() if line.startswith('sluice_websocket_turns_total{tenant="acme"}')
        ]
        assert counted
        assert float(counted[0].split()[-1]) >= 1


def test_codex_exec_through_a_pinned_upstream_socket(codex: Path, tmp_path: Path) -> None:
    """Against an OpenAI backend with the WebSocket mode (the fake of tests/support/openai_socket.py): Codex's
    warm-up opens the gateway's own socket upstream, and its turns go up it."""
    with FakeOpenAI(ttft_ms=20, tpot_ms=2, tokens=3) as fake:
        config = CONFIG.replace(
            "  sim: {type: simulated, ttft_ms: 50, tpot_ms: 5}",
            f'  sim: {{type: openai, base_url: "{fake.url}", api_key: backend-key}}',
        )
        with gateway_process(config, tmp_path, "--access-log", "--log-level", "info") as gw:
            home = codex_home(tmp_path / "codex", gw.base_url, "chat-large")
            run_codex(codex, home, tmp_path, "login", "--with-api-key", stdin=KEY)
            output = run_codex(codex, home, tmp_path, "exec", "--skip-git-repo-check", "Say ok")
            assert "Reconnecting" not in output
            assert "Falling back" not in output
            assert "tokens used" in output
    assert len(fake.sockets) == 1  # one upstream socket for Codex's one socket
    assert fake.sockets[0].headers["authorization"] == "Bearer backend-key"
    assert KEY not in str(fake.sockets[0].headers)
    # Codex names its conversation in `prompt_cache_key`: the key the `session` routing policy sticks to.
    assert all(create.get("prompt_cache_key") for create in fake.sockets[0].creates)
    # Its turn went up that socket (measured here: 1 create, no HTTP post); on a loaded machine the socket may still
    # be opening when the turn comes, and then it goes over HTTP: either way the upstream's name for the model.
    sent = [create["model"] for create in fake.sockets[0].creates] + [post.body["model"] for post in fake.posts]
    assert sent
    assert set(sent) == {"large"}
