"""Config: typed, strict, one-line errors that name the YAML path, ${ENV} expansion."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import QUICKSTART, QUICKSTART_YAML, describe, load, parse
from gateway.settings import ConfigError

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
    assert backend.type == "openai"
    assert backend.api_key == "sk-123"


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
            "backends: {s: {type: llamacpp, base_url: http://h:8080/v1}}\nmodels: {m: {backend: s, keep_alive: 5m}}",
            "models.m.keep_alive: only Ollama reads keep_alive; s is llamacpp",
        ),
        (
            "backends: {s: {type: simulated}}\nmodels: {m: {backend: s, warmup: {requests: -1}}}",
            "models.m.warmup.requests: Input should be greater than or equal to 0",
        ),
        ("backends: {s: {type: simulated}}\nmodels: {m: {backend: s, keep_warm_s: 0}}", "models.m.keep_warm_s"),
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


def test_self_hosted_backends_and_warmup() -> None:
    settings = parse(
        """
backends:
  t: {type: tgi, base_url: "http://tgi:80/v1"}
  l: {type: llamacpp, base_url: "http://llama:8080/v1", api_key: k}
  o: {type: ollama, base_url: "http://ollama:11434/v1"}
models:
  a: {backend: t, warmup: {}}
  b: {backend: l}
  c: {backend: o, keep_warm_s: 60, keep_alive: -1, warmup: {requests: 2, endpoint: embeddings}}
"""
    )
    assert [b.type for b in settings.backends.values()] == ["tgi", "llamacpp", "ollama"]
    warmup = settings.models["a"].warmup
    assert warmup is not None
    assert (warmup.requests, warmup.max_tokens, warmup.timeout_s) == (1, 1, 30.0)
    c = settings.models["c"]
    assert c.keep_warm_s == 60
    assert c.keep_alive == -1
    assert c.warmup is not None
    assert c.warmup.endpoint == "embeddings"


def test_shipped_configs_are_valid() -> None:
    assert "chat-large" in load("config/gateway.yaml").models
    assert load("config/local.yaml").models["small"].keep_warm_s == 60


SIM = "backends: {s: {type: simulated}}\nmodels: {m: {backend: s}, n: {backend: s}}\n"
KEY = "sha256:" + "ab" * 32


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse(text, "gw.yaml")
    lines = list(caught.value.lines)
    assert all(line.startswith("gw.yaml: ") for line in lines)
    return [line.removeprefix("gw.yaml: ") for line in lines]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        # A plugin's part without the plugin: never a feature silently off (auth would fail open).
        (
            f"auth: {{required: true}}\ntenants: {{acme: {{keys: ['{KEY}'], rate_limit: {{requests_per_minute: 5}}}}}}",
            [
                "auth: set, but the `auth` plugin is not in `plugins:` (add it, or remove this)",
                "tenants.acme.keys: set, but the `auth` plugin is not in `plugins:` (add it, or remove this)",
                "tenants.acme.rate_limit: set, but the `rate_limit` plugin is not in `plugins:` "
                "(add it, or remove this)",
            ],
        ),
        (
            "cache: {ttl_s: 5}",
            ["cache: set, but the `cache` plugin is not in `plugins:` (add it, or remove this)"],
        ),
        (
            "plugins: [rate_limit, auth]",
            ["plugins: 'auth' must come before 'rate_limit' (it runs first); list them in that order"],
        ),
        ("plugins: [cahce]", ["plugins[0]: unknown plugin 'cahce' (did you mean `cache`?)"]),
        ("plugins: [cache, cache]", ["plugins[1]: 'cache' is listed twice"]),
        (
            "plugins: [nowhere.to.be:Found]",
            ["plugins[0]: 'nowhere.to.be:Found': cannot import nowhere.to.be: No module named 'nowhere'"],
        ),
        (
            "plugins: [auth, rate_limit]\ntenants: {a: {rate_limit: {models: {chta: {requests_per_minute: 1}}}}}",
            ["tenants.a.rate_limit.models.chta: no model named 'chta'"],
        ),
        (
            "plugins: [rate_limit]\ntenants: {a: {rate_limit: {requests_per_minute: 1}}}",
            [
                "tenants.a.rate_limit: limits tenant 'a', but without the `auth` plugin (listed before `rate_limit`) "
                "every caller is tenant 'anonymous'"
            ],
        ),
        ("plugins: [auth]\ntenants: {a: {models: [q]}}", ["tenants.a.models: no model named 'q'"]),
        ("plugins: [auth]\nauth: {requird: true}", ["auth.requird: unknown key"]),
    ],
)
def test_plugin_parts_are_checked(extra: str, expected: list[str]) -> None:
    assert problems(SIM + extra) == expected


def test_model_keys_of_an_unlisted_plugin() -> None:
    text = SIM.replace("m: {backend: s}", "m: {backend: s, fallback: [n], slo: {}, hedge_after_ms: 5}")
    assert problems(text) == [
        "models.m.slo: set, but the `slo` plugin is not in `plugins:` (add it, or remove this)",
        "models.m.hedge_after_ms: set, but the `slo` plugin is not in `plugins:` (add it, or remove this)",
    ]
    assert problems(SIM.replace("m: {backend: s}", "m: {backend: s, slo: {}}") + "plugins: [slo]") == [
        "models.m.slo: an SLO needs a fallback to degrade to (set models.m.fallback)"
    ]


def test_every_problem_at_once_with_suggestions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOPE_KEY", raising=False)
    text = (
        "modles: {m: {backend: s}}\n"
        "backends: {s: {type: openai, base_url: 'https://x.test/v1', api_key: '${NOPE_KEY}'}}\n"
        "plugin: [auth]\n"
    )
    assert problems(text) == [
        "backends.s.api_key: environment variable NOPE_KEY is not set (use ${NOPE_KEY:-default} for a default)",
        "modles: unknown key (did you mean `models`?)",
        "plugin: unknown key (did you mean `plugins`?)",
    ]
    assert problems(SIM.replace("{backend: s}", "{backend: s, fallbak: [n]}", 1)) == [
        "models.m.fallbak: unknown key (did you mean `fallback`?)"
    ]


def test_a_plugin_from_a_package_owns_its_sections() -> None:
    text = SIM + (
        "plugins: ['tests.support.plugins:Greeter']\n"
        "greeter: {greeting: hello}\n"
        "models: {m: {backend: s, greet: true}, n: {backend: s}}\n"
    )
    settings = parse(text)
    config = settings.plugin_config("tests.support.plugins:Greeter")
    assert config.section.greeting == "hello"
    assert config.models["m"].greet
    assert not config.models["n"].greet
    assert problems(text.replace("greeting:", "greting:")) == ["greeter.greting: unknown key"]
    assert problems(text.replace("plugins: ['tests.support.plugins:Greeter']\n", "")) == [
        "greeter: unknown key",  # a plugin from a package is known only once it is listed
        "models.m.greet: unknown key",
    ]


def test_the_built_in_quickstart_is_the_shipped_one() -> None:
    # Outside the checkout `sluice serve` falls back to the built-in copy: it must serve the same models.
    shipped = parse(Path("config/gateway.yaml").read_text(), "config/gateway.yaml")
    built_in = parse(QUICKSTART_YAML, QUICKSTART)
    assert built_in.model_dump() == shipped.model_dump()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "backends: {sim: {type: simulatd}}\nmodels: {a: {backend: sim}}\n",
            "mine.yaml: backends.sim.type: unknown backend type 'simulatd' (did you mean `simulated`?); one of: ",
        ),
        ("backends: {sim: {type: simulated}}\nmodles: {a: {backend: sim}}\n", None),
        ("backends:\n  sim: {type: simulated\nmodels: x\n", "mine.yaml: not valid YAML: line 3, column 7: expected"),
    ],
)
def test_config_mistakes_read_as_a_user_would_say_them(text: str, expected: str | None) -> None:
    with pytest.raises(ConfigError) as raised:
        parse(text, "mine.yaml")
    lines = raised.value.args
    if expected is None:  # a misspelt required key is one mistake, not also a missing key
        assert lines == ("mine.yaml: modles: unknown key (did you mean `models`?)",)
    else:
        assert len(lines) == 1
        assert lines[0].startswith(expected), lines[0]
        assert "<unicode string>" not in lines[0]


def test_check_names_the_file_it_checked(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text("backends: {s: {type: simulated}}\nmodels: {only: {backend: s}}\n")
    assert describe(parse(path.read_text(), str(path))).startswith(f"ok: {path.resolve()}: 1 backend(s)")
    assert describe(parse(QUICKSTART_YAML, QUICKSTART)).startswith(f"ok: {QUICKSTART}: ")
