"""Running the gateway: its logs, readiness and status, backends that go down and come back, shutdown."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.gateway import free_port, gateway_process, gateway_thread
from tests.support.redis import RedisServer
from tests.support.upstream import Ok, ScriptedUpstream
from tests.support.wait import wait_until

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
BACKEND_KEY = "sk-backend-0123456789abcdef"
CLIENT_KEY = "sk-client-fedcba9876543210"


@pytest.fixture()
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream(default=Ok(ttft_ms=5, tpot_ms=2, tokens=4)) as up:
        yield up


def sim(port: int) -> subprocess.Popen[bytes]:
    """`sluice sim` on `port`, once it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "sim", "--port", str(port), "--ttft-ms", "5", "--tpot-ms", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    assert b"listening" in proc.stdout.readline()
    return proc


def metric(url: str, name: str, labels: str) -> float | None:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"{name}{{") and labels in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_logs_json_summary_access_lines_and_no_secrets(
    tmp_path: Path, upstream: ScriptedUpstream, redis_server: RedisServer
) -> None:
    dead = free_port()
    config = f"""
backends:
  main: {{type: openai, base_url: "{upstream.url}/v1", api_key: {BACKEND_KEY}}}
  gone: {{type: vllm, base_url: "http://127.0.0.1:{dead}/v1", timeouts: {{connect_s: 1}}}}
pool: {{warm_connections: 2}}
models:
  chat: {{backend: main, fallback: [spare]}}
  spare: {{backend: gone}}
tenants:
  acme: {{keys: ["sha256:{hashlib.sha256(CLIENT_KEY.encode()).hexdigest()}"]}}
redis: {{url: "{redis_server.url}"}}
auth: {{required: true}}
plugins: [auth]
"""
    args = ("--log-level", "debug", "--log-format", "json", "--access-log")
    with gateway_process(config, tmp_path, *args) as gw:
        headers = {"authorization": f"Bearer {CLIENT_KEY}"}
        whole = httpx.post(
            f"{gw.base_url}/chat/completions", json={"model": "chat", "messages": MESSAGES}, headers=headers
        )
        body = {"model": "chat", "messages": MESSAGES, "stream": True}
        streamed = httpx.post(f"{gw.base_url}/chat/completions", json=body, headers=headers)
        assert whole.status_code == streamed.status_code == 200
        rids = {whole.headers["x-request-id"], streamed.headers["x-request-id"]}

        def access() -> list[dict[str, Any]]:
            lines = [json.loads(line) for line in gw.log_text().splitlines() if line.startswith("{")]
            found = [line for line in lines if line["logger"] == "sluice.access"]
            return found if len(found) == 2 else []

        lines = wait_until(access, what="two access lines")
        assert {line["request_id"] for line in lines} == rids
        for line in lines:
            assert line["tenant"] == "acme"
            assert line["model"] == "chat"
            assert line["served_model"] == "chat"
            assert line["status"] == 200
            assert "cache" not in line  # no cache plugin
            assert line["level"] == "info"
            assert isinstance(line["ttft_ms"], float)
            assert line["total_ms"] >= line["ttft_ms"]
            assert 0 < line["overhead_ms"] < line["total_ms"]
        text = gw.log_text()
    entries = [json.loads(line) for line in text.splitlines()]  # every line is one JSON object
    assert all({"ts", "level", "logger", "message"} <= set(entry) for entry in entries)
    messages = [entry["message"] for entry in entries if entry["logger"] == "sluice"]
    config_path = str((tmp_path / f"gateway-{gw.port}.yaml").resolve())
    assert f"config: {config_path}" in messages
    assert any(m.startswith("backend main (openai,") and m.endswith("up, 2 warm connection(s)") for m in messages)
    assert any(m.startswith("backend gone (vllm,") and "down: cannot connect" in m for m in messages)
    assert "model chat -> main/chat, fallback spare" in messages
    assert "plugins: auth" in messages
    assert f"redis: 127.0.0.1:{redis_server.port}/0 reachable" in messages
    assert f"listening on http://127.0.0.1:{gw.port}" in messages
    assert any(e["logger"] == "uvicorn" and "Uvicorn running" in e["message"] for e in entries)
    assert BACKEND_KEY not in text
    assert CLIENT_KEY not in text


def test_text_logs_have_time_level_and_logger(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    config = f"""
backends: {{main: {{type: openai, base_url: "{upstream.url}/v1", api_key: {BACKEND_KEY}}}}}
models: {{chat: {{backend: main}}}}
"""
    with gateway_process(config, tmp_path, "--log-level", "info") as gw:
        text = wait_until(lambda: gw.log_text() if "Uvicorn running" in gw.log_text() else "")
    first = text.splitlines()[0].split()
    assert first[0].endswith("Z")
    assert first[1] in {"INFO", "WARNING"}
    assert first[2].endswith(":")
    assert "sluice: listening on" in text
    assert BACKEND_KEY not in text


def test_a_backend_down_at_start_is_reported_routed_around_and_retried(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    port = free_port()
    config = f"""
backends:
  main: {{type: openai, base_url: "http://127.0.0.1:{port}/v1", timeouts: {{connect_s: 2}}}}
  spare: {{type: openai, base_url: "{upstream.url}/v1"}}
pool: {{warm_connections: 1}}
models:
  chat: {{backend: main, fallback: [backup]}}
  backup: {{backend: spare}}
"""
    with gateway_process(config, tmp_path, "--log-level", "info") as gw:
        ready = httpx.get(f"{gw.url}/readyz")  # ready: a backend that is down does not take the pod out
        assert ready.status_code == 200
        down = ready.json()["backends"]["main"]
        assert down["state"] == "down"
        assert "cannot connect" in down["last_error"]
        assert down["last_error_at"]
        assert ready.json()["backends"]["spare"]["state"] == "up"
        assert metric(gw.url, "sluice_backend_up", 'backend="main"') == 0
        assert metric(gw.url, "sluice_backend_up", 'backend="spare"') == 1

        started = time.monotonic()
        served = httpx.post(f"{gw.base_url}/chat/completions", json={"model": "chat", "messages": MESSAGES})
        assert served.status_code == 200
        assert served.headers["x-sluice-model"] == "backup"
        assert served.headers["x-sluice-fallback"] == "error"
        assert time.monotonic() - started < 1.5  # the known-down primary was not waited on

        simulator = sim(port)  # the backend comes up: the background retry finds it
        try:

            def up() -> bool:
                state = httpx.get(f"{gw.url}/status").json()["backends"]["main"]
                return bool(state["state"] == "up" and state["warm_connections"] >= 1)

            wait_until(up, timeout=20, interval=0.2, what="main back up")
            served = httpx.post(f"{gw.base_url}/chat/completions", json={"model": "chat", "messages": MESSAGES})
            assert served.headers["x-sluice-model"] == "chat"
            assert metric(gw.url, "sluice_backend_up", 'backend="main"') == 1
        finally:
            simulator.terminate()
            simulator.wait(10)
            assert simulator.stdout is not None
            simulator.stdout.close()
        # It goes down again: the next request sees it and the state changes (and is logged) once.
        for _ in range(3):
            served = httpx.post(f"{gw.base_url}/chat/completions", json={"model": "chat", "messages": MESSAGES})
            assert served.status_code == 200
        wait_until(lambda: httpx.get(f"{gw.url}/status").json()["backends"]["main"]["state"] == "down")
        text = gw.log_text()
    assert text.count("backend main is down") == 2
    assert text.count("backend main is up again") == 1


def test_sigterm_lets_short_streams_finish_and_ends_long_ones_cleanly(tmp_path: Path) -> None:
    with ScriptedUpstream(default=Ok(ttft_ms=5, tpot_ms=500, tokens=200)) as slow:
        config = f"""
backends: {{slow: {{type: vllm, base_url: "{slow.url}/v1"}}}}
pool: {{warm_connections: 1}}
models: {{chat: {{backend: slow}}}}
shutdown: {{grace_s: 3}}
"""
        with gateway_process(config, tmp_path, "--log-level", "info") as gw:
            assert gw.proc is not None
            bodies: dict[int, str] = {}
            opened = threading.Semaphore(0)

            def stream(index: int) -> None:
                body = {"model": "chat", "messages": MESSAGES, "stream": True}
                with httpx.stream("POST", f"{gw.base_url}/chat/completions", json=body, timeout=60) as response:
                    parts: list[str] = []
                    for chunk in response.iter_text():
                        if not parts:
                            opened.release()
                        parts.append(chunk)
                bodies[index] = "".join(parts)

            # 8 streams of 200 tokens (100 s), then one of 5 tokens (1.25 s) that ends within the grace period.
            threads = [threading.Thread(target=stream, args=(i,)) for i in range(9)]
            for thread in threads[1:]:
                thread.start()
            for _ in threads[1:]:
                assert opened.acquire(timeout=30)
            slow.script(Ok(ttft_ms=5, tpot_ms=250, tokens=5))
            threads[0].start()
            assert opened.acquire(timeout=30)
            signalled = time.monotonic()
            gw.proc.send_signal(signal.SIGTERM)
            assert gw.proc.wait(30) == 0
            elapsed = time.monotonic() - signalled
            for thread in threads:
                thread.join(10)
            text = gw.log_text()
    assert 3 <= elapsed < 3 + 8.0
    assert bodies[0].rstrip().endswith("data: [DONE]")
    assert "error" not in bodies[0]
    for index in range(1, 9):
        events = [line for line in bodies[index].splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", bodies[index][-300:]
        assert json.loads(events[-2][6:])["error"]["code"] == "gateway_shutdown"
    assert "Traceback" not in text
    assert "CancelledError" not in text
    assert "Exception in ASGI" not in text
    assert "shutdown: 8 request(s) still running after shutdown.grace_s (3 s) ended with an error event" in text
    assert "Cancel 8 running task(s)" not in text


def test_pool_exhaustion_is_a_clear_503(upstream: ScriptedUpstream, caplog: pytest.LogCaptureFixture) -> None:
    upstream.default = Ok(ttft_ms=5, tpot_ms=100, tokens=20)
    config = f"""
backends: {{main: {{type: vllm, base_url: "{upstream.url}/v1"}}}}
pool: {{max_connections: 2, warm_connections: 1, pool_timeout_s: 0.2}}
models: {{chat: {{backend: main}}}}
"""
    with gateway_thread(config) as gw, httpx.Client(timeout=30) as client:
        body = {"model": "chat", "messages": MESSAGES, "stream": True}
        with (
            client.stream("POST", f"{gw.base_url}/chat/completions", json=body) as one,
            client.stream("POST", f"{gw.base_url}/chat/completions", json=body) as two,
        ):
            assert one.status_code == two.status_code == 200
            refused = httpx.post(f"{gw.base_url}/chat/completions", json=body)
            assert refused.status_code == 503
            error = refused.json()["error"]
            assert error["code"] == "upstream_pool_exhausted"
            assert "every connection to the upstream is busy" in error["message"]
            assert set(error) == {"message", "type", "param", "code"}
        assert metric(gw.url, "sluice_upstream_pool_exhausted_total", 'backend="main"') == 1
    assert any("connection pool exhausted" in record.getMessage() for record in caplog.records)


async def raw_stream(port: int, body: bytes) -> bytes:
    """One streamed request on its own connection, read to the end: the cheapest client there is."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        writer.write(head.encode() + body)
        return await reader.read(-1)
    finally:
        writer.close()


def test_a_thousand_concurrent_streams_on_default_pool_settings(tmp_path: Path) -> None:
    # Streams of 11 s: longer than pool.pool_timeout_s (10 s), so every one needs a connection of its own.
    port = free_port()
    simulator = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "sim", "--port", str(port), "--ttft-ms", "500", "--tpot-ms", "700"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert simulator.stdout is not None
        assert b"listening" in simulator.stdout.readline()
        config = f"""
backends: {{sim: {{type: vllm, base_url: "http://127.0.0.1:{port}/v1"}}}}
models: {{chat: {{backend: sim}}}}
"""
        with gateway_process(config, tmp_path) as gw:
            body = json.dumps({"model": "chat", "messages": MESSAGES, "stream": True}).encode()

            async def run() -> list[bytes]:
                return await asyncio.gather(*(raw_stream(gw.port, body) for _ in range(1000)))

            answers = asyncio.run(asyncio.wait_for(run(), 120))
            complete = sum(a.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in a for a in answers)
            errors = sum(b'"error"' in a for a in answers)
            assert (complete, errors) == (1000, 0)
            text = gw.log_text()
        assert "pool exhausted" not in text
    finally:
        simulator.terminate()
        simulator.wait(10)
        if simulator.stdout is not None:
            simulator.stdout.close()


def test_operator_basics_every_refusal_logged_status_and_process_series(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    from gateway import __version__

    dead = free_port()
    config = f"""
backends:
  pair: {{type: vllm, endpoints: ["{upstream.url}/v1", "http://127.0.0.1:{dead}/v1"], timeouts: {{connect_s: 1}}}}
models: {{chat: {{backend: pair}}}}
"""
    args = ("--log-level", "info", "--log-format", "json", "--access-log")
    with gateway_process(config, tmp_path, *args) as gw:
        refusals = {
            "unknown model": httpx.post(
                f"{gw.base_url}/chat/completions", json={"model": "nope", "messages": MESSAGES}
            ),
            "bad JSON": httpx.post(
                f"{gw.base_url}/chat/completions", content=b"{", headers={"content-type": "application/json"}
            ),
            "wrong method": httpx.get(f"{gw.base_url}/chat/completions"),
            "unknown URL": httpx.get(f"{gw.url}/nowhere"),
        }
        assert [r.status_code for r in refusals.values()] == [404, 400, 405, 404]
        rids = {r.headers["x-request-id"] for r in refusals.values()}

        def access() -> list[dict[str, Any]]:
            lines = [json.loads(line) for line in gw.log_text().splitlines() if line.startswith("{")]
            found = [line for line in lines if line["logger"] == "sluice.access" and line["request_id"] in rids]
            return found if len(found) == len(rids) else []

        lines = wait_until(access, what="an access line for every refusal")
        assert sorted(line["status"] for line in lines) == [400, 404, 404, 405]
        assert all(line["rejected_by"] == "gateway" and line["error"] for line in lines)
        assert any(line["model"] == "nope" for line in lines)

        status = httpx.get(f"{gw.url}/status").json()
        assert status["version"] == __version__
        assert status["uptime_s"] >= 0
        endpoints = status["backends"]["pair"]["endpoints"]
        assert [e["endpoint"] for e in endpoints] == [upstream.url.removeprefix("http://"), f"127.0.0.1:{dead}"]
        assert all(e["state"] in {"up", "ejected", "probing"} for e in endpoints)

        scraped = httpx.get(f"{gw.url}/metrics").text
        (build,) = [line for line in scraped.splitlines() if line.startswith("sluice_build_info{")]
        assert f'version="{__version__}"' in build
        for name in ("process_resident_memory_bytes", "process_open_fds", "process_cpu_seconds_total"):
            assert any(line.startswith(name + " ") for line in scraped.splitlines()), name
        messages = [json.loads(line)["message"] for line in gw.log_text().splitlines() if line.startswith("{")]
    assert any(m.startswith(f"backend pair (vllm, {upstream.url}/v1, http://127.0.0.1:{dead}/v1)") for m in messages)
    assert any(m.startswith("tracing: off (no telemetry.otlp_endpoint") for m in messages), messages
