"""`capacity: auto` against a real llama-server: its /slots read in the background, the configured number while
it is stopped, its slots again once it is back (the gateway under uvicorn, llama-server on a loopback port)."""

from __future__ import annotations

import httpx

from tests.support.gateway import gateway_thread
from tests.support.llamacpp import Start, gateway_metric, wait_for


def test_capacity_auto_reads_the_slots_and_falls_back_while_the_server_is_stopped(llama_servers: Start) -> None:
    (server,) = llama_servers(1, slots=3)
    config = f"""
backends:
  llama: {{type: llamacpp, base_url: "{server.base_url}"}}
models:
  tiny: {{backend: llama}}
admission:
  classes: [{{name: interactive}}]
  backends: {{llama: {{max_in_flight: 1, capacity: auto, poll_s: 0.1}}}}
plugins: [admission]
"""
    with gateway_thread(config) as gw:

        def capacity() -> float:
            return gateway_metric(gw.url, "sluice_admission_capacity", backend="llama")

        wait_for(lambda: capacity() == 3, 30, "the server's 3 slots")
        server.stop()
        wait_for(lambda: capacity() == 1, 30, "the configured 1 while the server is stopped")
        server.start()
        server.wait_ready()
        wait_for(lambda: capacity() == 3, 30, "its slots again once restarted")
        body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(f"{gw.base_url}/chat/completions", json=body, timeout=30).status_code == 200
