"""Who sees /status, /metrics and /readyz's detail: an admin listener, an admin token, or loopback only."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support.gateway import RunningGateway, free_port, gateway_process, gateway_thread, wait_ready

BASE = """
backends: {sim: {type: simulated, ttft_ms: 1, tpot_ms: 0, tokens: 2}}
models: {chat: {backend: sim}}
"""


def chat(gw: RunningGateway) -> None:
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{gw.base_url}/chat/completions", json=body).status_code == 200


def assert_tenant_port_is_closed(gw: RunningGateway) -> None:
    for path in ("/status", "/metrics"):
        response = httpx.get(gw.url + path)
        assert response.status_code == 404, (path, response.text)
        assert response.json()["error"]["code"] == "unknown_url"
    ready = httpx.get(gw.url + "/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready"}  # for probes: no backends, no Redis, no plugins
    assert httpx.get(gw.url + "/healthz").status_code == 200
    assert httpx.get(gw.base_url + "/models").status_code == 200


def test_an_admin_listener_serves_the_admin_routes_and_the_tenant_port_does_not() -> None:
    port = free_port()
    with gateway_thread(BASE + f"admin: {{port: {port}}}\n") as gw:
        chat(gw)
        assert_tenant_port_is_closed(gw)
        admin = f"http://127.0.0.1:{port}"
        status = httpx.get(admin + "/status")
        assert status.status_code == 200
        assert status.json()["backends"]["sim"]
        ready = httpx.get(admin + "/readyz")
        assert ready.status_code == 200
        assert "backends" in ready.json()
        metrics = httpx.get(admin + "/metrics")
        assert metrics.status_code == 200
        assert "sluice_requests_total{" in metrics.text
        assert httpx.get(admin + "/healthz").status_code == 200
        # The admin listener serves nothing else: not the API.
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(admin + "/v1/chat/completions", json=body).status_code == 404


def test_an_admin_token_is_required_for_the_admin_routes_on_the_tenant_port() -> None:
    config = BASE + "listen: {host: 0.0.0.0}\nadmin: {token: s3cret-admin}\n"  # not loopback: the token opens them
    with gateway_thread(config) as gw:
        for path in ("/status", "/metrics"):
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret-admin"}):
                refused = httpx.get(gw.url + path, headers=headers)
                assert refused.status_code == 401, (path, headers)
                error = refused.json()["error"]
                assert error["code"] == "invalid_admin_token"
                assert set(error) == {"message", "type", "param", "code"}
                assert refused.headers["www-authenticate"] == "Bearer"
            allowed = httpx.get(gw.url + path, headers={"authorization": "Bearer s3cret-admin"})
            assert allowed.status_code == 200, path
        assert httpx.get(gw.url + "/readyz").json() == {"status": "ready"}  # a probe needs no token
        detail = httpx.get(gw.url + "/readyz", headers={"authorization": "Bearer s3cret-admin"}).json()
        assert "backends" in detail


@pytest.mark.parametrize(("host", "open_"), [("0.0.0.0", False), ("127.0.0.1", True), ("localhost", True)])
def test_without_either_the_admin_routes_are_open_only_on_loopback(host: str, open_: bool) -> None:
    # The test binds 127.0.0.1 whatever the config says; what is decided follows `listen.host`.
    with gateway_thread(BASE + f"listen: {{host: {host}}}\n") as gw:
        if open_:
            assert httpx.get(gw.url + "/status").status_code == 200
            assert httpx.get(gw.url + "/metrics").status_code == 200
            assert "backends" in httpx.get(gw.url + "/readyz").json()
        else:
            assert_tenant_port_is_closed(gw)


def test_workers_share_the_admin_listener_and_follow_the_hosts_given_on_the_command_line(tmp_path: Path) -> None:
    port = free_port()
    # The config says 0.0.0.0, `--host` says loopback: the workers decide on what is listened on.
    config = BASE + f"listen: {{host: 0.0.0.0}}\nadmin: {{port: {port}}}\n"
    with gateway_process(config, tmp_path, "--workers", "2", "--host", "127.0.0.1") as gw:
        admin = f"http://127.0.0.1:{port}"
        wait_ready(admin)
        chat(gw)
        assert_tenant_port_is_closed(gw)
        for _ in range(6):  # new connections, spread over both workers: each answers on the shared port
            with httpx.Client() as client:
                assert client.get(admin + "/status").status_code == 200
        assert "sluice_requests_total{" in httpx.get(admin + "/metrics").text
    with gateway_process(BASE + "listen: {host: 0.0.0.0}\n", tmp_path, "--workers", "2", "--host", "127.0.0.1") as gw:
        assert httpx.get(gw.url + "/status").status_code == 200  # loopback, as --host said
