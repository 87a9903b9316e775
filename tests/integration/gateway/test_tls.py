"""HTTPS upstreams: TLS done once at warm-up, a private CA trusted through `tls.ca_file`, bad certificates refused."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
from pathlib import Path
from typing import Any

import httpx
import trustme
from openai.types.chat import ChatCompletionMessageParam

from gateway.simulation.answers import Profile
from tests.support.gateway import free_port, gateway_thread
from tests.support.wait import wait_until
from tools.sim.server import start_server

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


def config(port: int, tls: str) -> str:
    return f"""
backends:
  secure: {{type: vllm, base_url: "https://localhost:{port}/v1", tls: {tls}}}
pool: {{warm_connections: 2}}
models: {{m: {{backend: secure}}}}
"""


async def test_https_upstream_with_a_private_ca(tmp_path: Path) -> None:
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_context)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    server = await start_server("127.0.0.1", 0, Profile(ttft_ms=5, tpot_ms=1, tokens=4), tls=server_context)
    port = server.sockets[0].getsockname()[1]
    try:

        def through(tls: str, stream: bool, ready: bool = True) -> httpx.Response:
            with gateway_thread(config(port, tls), ready=ready) as gw:
                if not ready:  # it could not warm a connection: ready all the same, and the backend reported down
                    readiness = httpx.get(f"{gw.url}/readyz")
                    assert readiness.status_code == 200
                    assert readiness.json()["backends"]["secure"]["state"] == "down"
                body = {"model": "m", "messages": MESSAGES, "stream": stream}
                return httpx.post(f"{gw.base_url}/chat/completions", json=body, timeout=10)

        trusted = await asyncio.to_thread(through, f"{{ca_file: '{ca_file}'}}", True)
        assert trusted.status_code == 200
        assert trusted.text.rstrip().endswith("data: [DONE]")
        timing = trusted.headers["server-timing"]
        # The handshakes happened at warm-up: getting a connection costs (next to) nothing.
        pool_ms = float(timing.split("pool;dur=")[1].split(",")[0])
        assert pool_ms < 5.0, timing
        unchecked = await asyncio.to_thread(through, "{verify: false}", False)
        assert unchecked.status_code == 200
        assert unchecked.json()["choices"]
        untrusted = await asyncio.to_thread(through, "{}", False, False)  # the system CAs do not know ours
        assert untrusted.status_code == 502
        assert untrusted.json()["error"]["code"] == "connect_error"
    finally:
        server.close()
        await server.wait_closed()


async def h2_upstream(scope: Any, receive: Any, send: Any) -> None:
    """A minimal OpenAI-shaped upstream that says which HTTP version it was reached over."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    version = scope["http_version"].encode()
    events = [
        b'data: {"choices":[{"index":0,"delta":{"content":"over http/' + version + b'"},"finish_reason":null}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
        b"data: [DONE]\n\n",
    ]
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for event in events:
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_http2_backend(tmp_path: Path) -> None:
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    ca = trustme.CA()
    cert = ca.issue_cert("localhost")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    port = free_port()
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.certfile = config.keyfile = str(tmp_path / "server.pem")
    config.loglevel = "WARNING"
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    server = threading.Thread(
        target=lambda: loop.run_until_complete(serve(h2_upstream, config, shutdown_trigger=stop.wait))
    )
    server.start()
    try:
        wait_until(lambda: listening(port), timeout=30, what="the HTTP/2 upstream listening")
        text = f"""
backends:
  h2: {{type: openai, base_url: "https://localhost:{port}/v1", tls: {{ca_file: "{tmp_path / "ca.pem"}"}}}}
pool: {{http2: true, warm_connections: 1}}
models: {{m: {{backend: h2}}}}
"""
        with gateway_thread(text) as gw:
            body = {"model": "m", "messages": MESSAGES, "stream": True}
            answer = httpx.post(f"{gw.base_url}/chat/completions", json=body, timeout=10)
            assert answer.status_code == 200, answer.text
            assert "over http/2" in answer.text
            assert answer.text.rstrip().endswith("data: [DONE]")
    finally:
        loop.call_soon_threadsafe(stop.set)
        server.join(10)
        loop.close()
