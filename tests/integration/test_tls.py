"""HTTPS upstreams: TLS done once at warm-up, a private CA trusted through `tls.ca_file`, bad certificates refused."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import httpx
import trustme

from gateway.simulation import Profile
from gateway.tools.sim import start_server
from tests.support.gateway import gateway_thread

MESSAGES = [{"role": "user", "content": "hello"}]


def config(port: int, tls: str) -> str:
    return f"""
backends:
  secure: {{type: vllm, base_url: "https://localhost:{port}/v1", tls: {tls}}}
pool: {{warm_connections: 2}}
models: {{m: {{backend: secure}}}}
auth: {{required: false}}
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
                if not ready:
                    assert httpx.get(f"{gw.url}/readyz").status_code == 503  # it could not warm a connection
                body = {"model": "m", "messages": MESSAGES, "stream": stream}
                return httpx.post(f"{gw.base_url}/chat/completions", json=body, timeout=10)

        trusted = await asyncio.to_thread(through, f"{{ca_file: '{ca_file}'}}", True)
        assert trusted.status_code == 200 and trusted.text.rstrip().endswith("data: [DONE]")
        timing = trusted.headers["server-timing"]
        # The handshakes happened at warm-up: getting a connection costs (next to) nothing.
        pool_ms = float(timing.split("pool;dur=")[1].split(",")[0])
        assert pool_ms < 5.0, timing
        unchecked = await asyncio.to_thread(through, "{verify: false}", False)
        assert unchecked.status_code == 200 and unchecked.json()["choices"]
        untrusted = await asyncio.to_thread(through, "{}", False, False)  # the system CAs do not know ours
        assert untrusted.status_code == 502 and untrusted.json()["error"]["code"] == "connect_error"
    finally:
        server.close()
        await server.wait_closed()
