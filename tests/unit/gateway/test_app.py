"""The app's own logic: which proxy path is which endpoint, and how a worker builds its app from the hand-off."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway import handoff
from gateway.app import ENDPOINTS, create_app, proxy_route


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/v1/chat/completions", ("chat/completions", None)),
        ("/chat/completions", ("chat/completions", None)),
        ("/openai/v1/responses", ("responses", None)),
        ("/openai/deployments/gpt-4o/chat/completions", ("chat/completions", "gpt-4o")),
        ("/openai/v1/deployments/gpt-4o/embeddings", ("embeddings", "gpt-4o")),
        ("/openai/deployments/gpt-4o/responses", ("responses", "gpt-4o")),
        ("/openai/deployments//chat/completions", None),  # no deployment named
        ("/openai/deployments/gpt-4o/unknown", None),
        ("/openai/deployments/gpt-4o", None),
        ("/v1/models", None),  # not a proxy path: Starlette serves it
        ("/v2/chat/completions", None),
    ],
)
def test_proxy_route(path: str, expected: tuple[str, str | None] | None) -> None:
    assert proxy_route(path) == expected


def test_every_fixed_path_is_its_own_route() -> None:
    for path, endpoint in ENDPOINTS.items():
        assert proxy_route(path) == (endpoint, None)


CONFIG = """
listen: {host: 0.0.0.0, port: 8080}
backends: {sim: {type: simulated}}
models: {m: {backend: sim}}
"""


def test_a_worker_builds_its_app_from_the_hand_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(CONFIG)
    monkeypatch.setenv(handoff.CONFIG, str(config))
    monkeypatch.setenv(handoff.ACCESS_LOG, "1")
    monkeypatch.setenv(handoff.LISTEN, "127.0.0.1:9100")  # what --host and --port made of the config
    monkeypatch.delenv(handoff.SUPERVISOR, raising=False)  # no supervisor: nothing to tie the process to
    app = create_app()
    assert app.settings.source == str(config)
    assert app.settings.log.access
    assert (app.settings.listen.host, app.settings.listen.port) == ("127.0.0.1", 9100)
    assert app.admin.here  # the supervisor listens on loopback: the admin routes are open there


def test_without_the_hand_off_a_worker_takes_the_config_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(CONFIG)
    monkeypatch.setenv(handoff.CONFIG, str(config))
    for name in (handoff.ACCESS_LOG, handoff.LISTEN, handoff.SUPERVISOR):
        monkeypatch.delenv(name, raising=False)
    app = create_app()
    assert not app.settings.log.access
    assert app.settings.listen.host == "0.0.0.0"
    assert not app.admin.here  # not loopback and no token: not served on the tenants' port
