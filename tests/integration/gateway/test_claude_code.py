"""Claude Code through `sluice serve`: `claude -p` answered on the simulated backend, with 0 failed requests.

Claude Code sends `POST /v1/messages?beta=true` with a system prompt of several thousand tokens, its tool
definitions, `system` turns inside the conversation, `thinking`, `context_management` and `output_config`, and
checks its base URL with `HEAD /api/hello`. Every one of its requests must succeed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.simulation.answers import WORDS
from plugins.auth.keys import new_key
from tests.support.claude_code import install_or_skip, run
from tests.support.gateway import RunningGateway, gateway_process
from tests.support.wait import wait_until

KEY, HASH = new_key()
CONFIG = f"""
backends:
  sim: {{type: simulated, ttft_ms: 20, tpot_ms: 2, tokens: 6}}
models:
  chat-large: {{backend: sim, upstream_model: large}}
tenants:
  acme: {{keys: ["{HASH}"], rate_limit: {{requests_per_minute: 100}}}}
plugins: [auth, rate_limit, cache]
"""
ACCESS = re.compile(r"sluice\.access: (\S+(?: \S+)?) (\d{3}) ")


@pytest.fixture(scope="module")
def claude() -> Path:
    return install_or_skip()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    tmp = tmp_path_factory.mktemp("gateway")
    with gateway_process(CONFIG, tmp, "--log-level", "info", "--access-log") as gw:
        yield gw


def requests(gw: RunningGateway) -> list[tuple[str, int]]:
    return [(what, int(status)) for what, status in ACCESS.findall(gw.log_text())]


def test_claude_code_says_ok(claude: Path, gateway: RunningGateway, tmp_path: Path) -> None:
    done = run(claude, gateway.url, tmp_path, "Say ok", "chat-large", key=KEY)
    assert done.returncode == 0, f"stdout: {done.stdout}\nstderr: {done.stderr}"
    answer = done.stdout.split()
    assert answer, done.stderr
    assert all(word in WORDS for word in answer)  # the simulated model's words, as Claude Code printed them
    assert "API Error" not in done.stdout + done.stderr
    # The access line is written once the last byte has gone, which may be just after Claude Code exits.
    wait_until(lambda: ("messages", 200) in requests(gateway), what="the access line")
    seen = requests(gateway)
    failed = [(what, status) for what, status in seen if status >= 400]
    assert failed == [], gateway.log_text()[-4000:]


def test_claude_code_with_a_wrong_key_is_told_so(claude: Path, gateway: RunningGateway, tmp_path: Path) -> None:
    """At once: the 401 says `x-should-retry: false`, which Claude Code honours (it retries a 401 for minutes
    otherwise)."""
    before = len(requests(gateway))
    done = run(claude, gateway.url, tmp_path, "Say ok", "chat-large", key="sk-not-a-key", timeout=60)
    assert done.returncode != 0
    assert "API Error: 401" in done.stdout + done.stderr
    wait_until(lambda: len(requests(gateway)) > before, what="the access line")
    assert requests(gateway)[before:] == [("messages", 401)]
