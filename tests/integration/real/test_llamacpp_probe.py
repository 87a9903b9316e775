"""`sluice probe` against a real llama-server: prefill, its prompt cache and its queue, each named in the diagnosis.

The probe runs in-process through its CLI entry points and writes its JSON document, which is read here. Times
are compared only as ratios within one run; the server's own counters (`/metrics`) confirm what the probe saw.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.support.gateway import gateway_process
from tests.support.llamacpp import Start
from tools.llamacpp_server import LlamaServer
from tools.probe import add_arguments, main


def probe(tmp_path: Path, *argv: str) -> dict[str, Any]:
    """The JSON document of one in-process run (a failed request is allowed: llama-server may close a kept-alive
    connection between answers, and the probe says so)."""
    parser = argparse.ArgumentParser(prog="sluice probe")
    add_arguments(parser)
    path = tmp_path / "probe.json"
    args = parser.parse_args([*argv, "--json", str(path), "--timeout", "30"])
    with contextlib.redirect_stdout(io.StringIO()):
        main(args)
    doc: dict[str, Any] = json.loads(path.read_text())
    assert doc["failure"] is None, doc["failure"]
    return doc


def codes(doc: dict[str, Any]) -> set[str]:
    return {finding["code"] for finding in doc["findings"]}


def metric(server: LlamaServer, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=5.0).text.splitlines():
        if line.startswith(f"llamacpp:{name} "):
            return float(line.split()[1])
    raise AssertionError(f"llamacpp:{name} not in /metrics")


def warm(server: LlamaServer) -> None:
    """One unrelated request first, so that the server's own first-request costs stay out of the prompt
    comparisons (the probe names them cold_start otherwise)."""
    body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2}
    assert httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=30.0).status_code == 200


@contextlib.contextmanager
def busy(server: LlamaServer, clients: int, tokens: int) -> Iterator[list[int]]:
    """`clients` threads that keep sending long generations, more than the server has slots: the probe's
    requests wait in its queue. Yields the count of answers, growing."""
    stop = threading.Event()
    done = [0]

    def loop() -> None:
        with httpx.Client(timeout=60.0) as client:
            while not stop.is_set():
                body = {"messages": [{"role": "user", "content": "Go on"}], "max_tokens": tokens}
                client.post(f"{server.base_url}/chat/completions", json=body)
                done[0] += 1

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    try:
        yield done
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)


def test_prefill_grows_with_the_prompt_and_the_cache_skips_it(llama_servers: Start, tmp_path: Path) -> None:
    (server,) = llama_servers(slots=1)
    warm(server)
    processed = metric(server, "prompt_tokens_total")
    doc = probe(tmp_path, server.base_url, "--samples", "2")
    (target,) = doc["targets"]
    first = target["first_ttft_ms"]
    repeats = [
        c["phases"]["ttft_ms"]["p50"] for c in target["cells"] if c["probe"] == "long" and c["stream"] and c["count"]
    ]
    print(f"first TTFT (ms): {first}; long repeated p50s (ms): {repeats}; findings: {sorted(codes(doc))}")
    # Prefill grows with the prompt: the first time each prompt is sent, the longer waits longer.
    assert first["long"] > 2 * first["minimal"], first
    assert first["long"] > first["medium"], first
    # The cache: every repeat of the long prompt is faster than its first run.
    assert repeats
    assert max(repeats) * 2 < first["long"], (repeats, first)
    assert {"prefill", "prompt_cache"} <= codes(doc), doc["findings"]
    assert "queueing" not in codes(doc), doc["findings"]
    # The server's account: it prefilled far fewer prompt tokens than the probe sent, the rest came from its cache.
    sent = sum(s["probe"] == "long" and s["status"] == 200 for s in doc["samples"])
    long_tokens = 900  # the long probe's prompt is ~1,000 tokens
    assert sent >= 5
    assert metric(server, "prompt_tokens_total") - processed < (sent - 2) * long_tokens


def test_through_sluice_serve_the_cache_and_prefill_are_named(llama_servers: Start, tmp_path: Path) -> None:
    (server,) = llama_servers(slots=1)
    warm(server)
    config = f"""
backends:
  llama: {{type: llamacpp, base_url: "{server.base_url}"}}
pool: {{warm_connections: 1}}
models:
  tiny: {{backend: llama}}
"""
    with gateway_process(config, tmp_path) as gw:
        doc = probe(tmp_path, gw.base_url, "--samples", "1", "--model", "tiny")
    (target,) = doc["targets"]
    first = target["first_ttft_ms"]
    print(f"through sluice serve, first TTFT (ms): {first}; findings: {sorted(codes(doc))}")
    assert first["long"] > 2 * first["minimal"], first
    assert {"prefill", "prompt_cache"} <= codes(doc), doc["findings"]
    assert "queueing" not in codes(doc), doc["findings"]


def test_more_requests_than_slots_is_named_queueing(llama_servers: Start, tmp_path: Path) -> None:
    (server,) = llama_servers(slots=1)
    warm(server)
    with busy(server, clients=2, tokens=150) as done:
        # Both clients' requests are at the server before the probe starts.
        doc = probe(tmp_path, server.base_url, "--samples", "2", "--probes", "minimal")
        answered = done[0]
    (target,) = doc["targets"]
    cell = next(c for c in target["cells"] if c["probe"] == "minimal" and c["stream"] and c["connection"] == "fresh")
    print(
        f"minimal TTFT p50 under load: {cell['phases']['ttft_ms']['p50']} ms; background answers: {answered}; "
        f"findings: {sorted(codes(doc))}"
    )
    assert answered >= 2  # the slot was taken by the other clients while the probe ran
    assert "queueing" in codes(doc), doc["findings"]
    found = next(f for f in doc["findings"] if f["code"] == "queueing")
    # The wait is long against the server's own pace: many decode steps before the first token of two.
    assert found["evidence"]["server_ms"] > 10 * max(found["evidence"]["tpot_p50_ms"] or 0.0, 1.0)
