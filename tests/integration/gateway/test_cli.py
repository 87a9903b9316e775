"""The command line as a user runs it: check, serve with a bad config, serve with several workers."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai

from gateway.cli import parser
from plugins.auth.keys import new_key
from tests.support.gateway import gateway_process
from tests.support.redis import RedisServer

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


def test_serve_on_a_busy_port_says_so_before_it_says_listening(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(SIM)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = sluice("serve", "-c", str(path), "--port", str(port))
    assert result.returncode != 0
    assert "listening on" not in result.stderr, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"cannot listen on 127.0.0.1:{port}" in line


def flags(command: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """A command's options, and those of its own subcommands."""
    for action in command._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from flags(sub)
        elif action.option_strings and action.dest != "help":
            yield action


def test_version_and_help_for_every_flag() -> None:
    from gateway import __version__

    version = sluice("--version")
    assert version.returncode == 0
    assert version.stdout.strip() == f"sluice {__version__}"
    assert sluice("serve", "--help").returncode == 0
    for command in ("serve", "check", "sim", "keys", "cache", "bench", "probe", "demo"):
        (sub,) = [a for a in parser(command)._actions if isinstance(a, argparse._SubParsersAction)]
        options = list(flags(sub.choices[command]))
        assert options, command
        bare = [a.option_strings[-1] for a in options if not a.help]
        assert bare == [], f"sluice {command}: options without help: {bare}"


def test_keys_say_what_they_did_or_could_not(tmp_path: Path, redis_server: RedisServer) -> None:
    refused = sluice("keys", "new")
    assert refused.returncode == 2
    assert "required: --tenant" in refused.stderr
    helped = sluice("keys", "new", "--help")  # its own options, not every action's
    assert helped.returncode == 0
    assert "--tenant" in helped.stdout
    assert "--redis" not in helped.stdout
    made = sluice("keys", "new", "--tenant", "acme")
    assert made.returncode == 0
    assert "tenant: acme" in made.stdout
    listed = sluice("keys", "list", "--redis", redis_server.url)
    assert listed.returncode == 0
    assert listed.stdout.startswith("no keys in Redis at")
    key, hashed = new_key()
    config = tmp_path / "gw.yaml"
    config.write_text(
        SIM + f"redis: {{url: {redis_server.url}}}\nplugins: [auth]\ntenants: {{acme: {{keys: ['{hashed}']}}}}\n"
    )
    revoked = sluice("keys", "revoke", "-c", str(config), "--key", key)
    assert revoked.returncode == 1
    assert "is a key of tenant 'acme' in the config" in revoked.stderr
    assert "remove it from tenants.acme.keys" in revoked.stderr
    other, _ = new_key()
    unknown = sluice("keys", "revoke", "--redis", redis_server.url, "--key", other)
    assert unknown.returncode == 1
    assert "is not in Redis" in unknown.stderr
    assert sluice("keys", "add", "--redis", redis_server.url, "--tenant", "acme", "--key", other).returncode == 0
    gone = sluice("keys", "revoke", "--redis", redis_server.url, "--key", other)
    assert gone.returncode == 0
    assert gone.stdout.startswith("revoked sha256:")


def test_auth_with_no_key_anywhere_is_a_warning_from_check_and_serve(tmp_path: Path) -> None:
    """Valid, yet every request would be a 401: both commands say so, in the same words, and neither refuses it."""
    text = SIM + "plugins: [auth]\n"
    path = tmp_path / "auth.yaml"
    path.write_text(text)
    result = sluice("check", "-c", str(path))
    assert result.returncode == 0, result.stderr
    warning = (
        f"{path}: plugins: auth is on with no key in any tenant and no Redis to hold keys: every request gets a 401"
    )
    assert result.stdout.splitlines()[1:] == [f"warning: {warning}"]
    with gateway_process(text, tmp_path) as gw:
        assert "every request gets a 401" in gw.log_text()
    # With a key in a tenant, nothing to say.
    keyed = SIM + f"tenants: {{a: {{keys: ['{new_key()[1]}']}}}}\nplugins: [auth]\n"
    path.write_text(keyed)
    result = sluice("check", "-c", str(path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 1, result.stdout
