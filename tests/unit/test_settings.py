"""Config: typed, strict, one-line errors that name the YAML path, ${ENV} expansion."""

from __future__ import annotations

import pytest

from gateway.settings import ConfigError, load, parse

BASE = """
backends:
  up: {type: openai, base_url: "https://api.example.test/v1", api_key: "${TEST_KEY}"}
models:
  m: {backend: up}
"""


def test_env_expansion(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_KEY", "sk-123")
    settings = parse(BASE)
    backend = settings.backends["up"]
    assert backend.type == "openai" and backend.api_key == "sk-123"


def test_env_default_and_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match="TEST_KEY is not set"):
        parse(BASE)
    settings = parse(BASE.replace("${TEST_KEY}", "${TEST_KEY:-fallback}"))
    assert settings.backends["up"].api_key == "fallback"  # type: ignore[union-attr]
    monkeypatch.setenv("TEST_KEY", "")
    assert parse(BASE.replace("${TEST_KEY}", "${TEST_KEY:-fallback}")).backends["up"].api_key == "fallback"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("yaml_text", "expected"),
    [
        ("backends: {}\nmodels: {m: {backend: nope}}", "models.m.backend: no backend named 'nope'"),
        ("backends: {s: {type: simulated}}\nmodels: {m: {backend: s, fallback: [x]}}", "no model named 'x'"),
        ("backends: {s: {type: simulated, ttft: 3}}\nmodels: {m: {backend: s}}", "backends.s.ttft: unknown key"),
        ("backends: {s: {type: nope}}\nmodels: {m: {backend: s}}", "backends.s"),
        ("backends: {s: {type: openai, base_url: ftp://x}}\nmodels: {m: {backend: s}}", "base_url must start"),
        (
            "backends: {s: {type: simulated}}\nmodels: {m: {backend: s}}\npool: {max_connections: 0}",
            "pool.max_connections",
        ),
        ("backends: {s: {type: simulated}}\nmodels: {m: {backend: s}}\ntypo: 1", "typo: unknown key"),
        (
            "backends: {s: {type: simulated}}\nmodels: {m: {backend: s}}\nredis: {url: 'http://:pw@h:1'}",
            "redis.url: unsupported Redis URL scheme 'http'",
        ),
        (
            "backends: {s: {type: simulated}}\nmodels: {m: {backend: s}}\nredis: {url: 'redis+cluster://a:1,b:x'}",
            "redis.url: port 'x' is not a number",
        ),
        ("- a list", "top level must be a mapping"),
        ("a: [unclosed", "not valid YAML"),
    ],
)
def test_errors_name_the_path(yaml_text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse(yaml_text, "gw.yaml")
    message = str(caught.value)
    assert message.startswith("gw.yaml: ")
    assert expected in message
    assert "\n" not in message


def test_load_order(monkeypatch: pytest.MonkeyPatch, tmp_path: pytest.TempPathFactory) -> None:
    monkeypatch.chdir(tmp_path)  # type: ignore[arg-type]
    monkeypatch.delenv("SLUICE_CONFIG", raising=False)
    assert "chat-large" in load().models  # no file anywhere: the built-in quickstart
    path = tmp_path / "mine.yaml"  # type: ignore[operator]
    path.write_text("backends: {s: {type: simulated}}\nmodels: {only: {backend: s}}\n")
    monkeypatch.setenv("SLUICE_CONFIG", str(path))
    assert list(load().models) == ["only"]
    with pytest.raises(ConfigError, match="cannot read"):
        load("/nonexistent/gw.yaml")


def test_shipped_configs_are_valid() -> None:
    assert "chat-large" in load("config/gateway.yaml").models
