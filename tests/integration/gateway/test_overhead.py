"""`x-sluice-overhead-ms` and the `parse` stage start when the request's first byte arrives.

The HTTP/1.1 protocol stamps the first byte of a request (httptools' message begin), so what lies between it
and the application (the rest of the head, its parse, the dispatch) is counted too. The check does not compare
timings, which swing on a busy machine: a request whose head arrives in two parts, PAUSE_S apart, must show at
least that pause in the gateway's own figures. Counted from the application's start, they would not.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from tests.support.gateway import gateway_process
from tests.support.upstream import Ok, ScriptedUpstream

PAUSE_S = 0.05
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5})


@pytest.fixture()
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream(default=Ok(tokens=5)) as up:
        yield up


class Client:
    """One keep-alive connection, one request at a time: nothing between the clock reads but the exchange."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(BODY), BODY)
        )

    def exchange(self, pause_after: int = 0) -> tuple[float, dict[bytes, bytes]]:
        """(ms from the request's send to the answer's last byte, the answer's headers); with `pause_after`, the
        request's first that many bytes, then PAUSE_S, then the rest."""
        started = time.perf_counter()
        if pause_after:
            self.sock.sendall(self.request[:pause_after])
            time.sleep(PAUSE_S)  # the stimulus, not a wait for a condition
            self.sock.sendall(self.request[pause_after:])
        else:
            self.sock.sendall(self.request)
        data = b""
        while b"\r\n\r\n" not in data:
            data += self.sock.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
        length = int(headers[b"content-length"])
        while len(body) < length:
            body += self.sock.recv(65536)
        elapsed = (time.perf_counter() - started) * 1000.0
        assert head.startswith(b"HTTP/1.1 200"), head
        return elapsed, headers

    def close(self) -> None:
        self.sock.close()


def test_overhead_counts_from_the_first_byte(upstream: ScriptedUpstream, tmp_path: Path) -> None:
    config = f"""
backends:
  up: {{type: openai, base_url: "{upstream.url}/v1"}}
pool: {{warm_connections: 1}}
models:
  m: {{backend: up}}
"""
    with gateway_process(config, tmp_path) as gw:
        client = Client(gw.port)
        try:
            _, whole = client.exchange()  # the whole request at once: a warm connection, a figure far below the pause
            _, split = client.exchange(pause_after=12)  # "POST /v1/ch", PAUSE_S, then the rest
        finally:
            client.close()
    pause_ms = PAUSE_S * 1000.0
    assert float(whole[b"x-sluice-overhead-ms"]) < pause_ms
    assert float(split[b"x-sluice-overhead-ms"]) >= 0.9 * pause_ms, split
    stages = dict(entry.split(";dur=") for entry in split[b"server-timing"].decode().split(", "))
    assert float(stages["parse"]) >= 0.9 * pause_ms, stages
