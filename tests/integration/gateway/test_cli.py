"""The command line as a user runs it: check, serve with a bad config, serve with several workers."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import openai

from tests.support.gateway import gateway_process

SIM = "backends: {s: {type: simulated, ttft_ms: 5, tpot_ms: 1, tokens: 4}}\nmodels: {m: {backend: s}}\n"


def sluice(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True, timeout=60)


def test_check_accepts_the_quickstart() -> None:
    result = sluice("check", "-c", "config/gateway.yaml")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok:")


def test_bad_config_stops_serve_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("backends: {s: {type: simulated}}\nmodels: {m: {backend: missing}}\n")
    for command in ("check", "serve"):
        result = sluice(command, "-c", str(path))
        assert result.returncode == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert "models.m.backend" in lines[0]
        assert str(path) in lines[0]


BAD = """
backends: {s: {type: simulated}, tls: {type: openai, base_url: "https://x.test/v1", tls: {ca_file: /nowhere.pem}}}
models: {chat: {backend: s}}
tenants: {a: {rate_limit: {models: {chta: {requests_per_minute: 1}}}}}
plugins: [auth, rate_limit, cahce]
"""


def test_check_and_serve_say_the_same_lines_for_every_problem(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD)
    said = []
    for command in ("check", "serve"):
        result = sluice(command, "-c", str(path))
        assert result.returncode == 2
        assert "Traceback" not in result.stderr
        assert not result.stdout
        said.append(result.stderr.splitlines())
    assert (
        said[0]
        == said[1]
        == [
            f"sluice: config error: {path}: plugins[2]: unknown plugin 'cahce' (did you mean `cache`?)",
            f"sluice: config error: {path}: tenants.a.rate_limit.models.chta: no model named 'chta'",
        ]
    )
    # Once the config parses, what only building it finds (a CA file that is not there) is said the same way.
    path.write_text(BAD.replace(", cahce", "").replace("chta", "chat"))
    for command in ("check", "serve"):
        result = sluice(command, "-c", str(path))
        assert result.returncode == 2
        assert "Traceback" not in result.stderr
        assert result.stderr.splitlines() == [
            f"sluice: config error: {path}: backends.tls.tls.ca_file: cannot load /nowhere.pem: "
            "No such file or directory"
        ]


def test_serve_with_two_workers(tmp_path: Path) -> None:
    with gateway_process(SIM, tmp_path, "--workers", "2") as gw:
        client = openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0)
        for _ in range(10):
            answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            assert answer.choices[0].finish_reason == "stop"


def test_a_busy_port_is_one_line_not_a_traceback() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = sluice("sim", "--port", str(port))
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert f"127.0.0.1:{port}" in lines[0]
    assert "in use" in lines[0]
