"""Usage for every stream: the official SDK streaming with and without `include_usage`, through the gateway.

Three upstreams that honour `stream_options.include_usage`: the scripted one, `sluice sim` as its own process
and the in-process simulated backend. The client must get exactly the stream it asked for (no usage chunk
unless it asked, then exactly one), and the gateway's metrics and spans must carry the tokens either way.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from plugins.auth.keys import new_key
from tests.integration.gateway.test_telemetry import OtlpReceiver, Span, metric, scrape
from tests.support.gateway import RunningGateway, free_port, gateway_thread, wait_ready
from tests.support.upstream import Ok, ScriptedUpstream

KEY, KEY_HASH = new_key()
MESSAGES: Any = [{"role": "user", "content": "What is a sluice?"}]
TOKENS = 6


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    port = free_port()
    profile = ["--ttft-ms", "5", "--tpot-ms", "1", "--tokens", str(TOKENS)]
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "sim", "--port", str(port), *profile])
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, path="/healthz")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture()
def setup(
    monkeypatch: pytest.MonkeyPatch, sim_url: str
) -> Iterator[tuple[RunningGateway, ScriptedUpstream, OtlpReceiver, str]]:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    receiver = OtlpReceiver()
    with ScriptedUpstream(default=Ok(ttft_ms=5, tpot_ms=2, tokens=TOKENS)) as up:
        yaml = f"""
backends:
  scripted: {{type: openai, base_url: "{up.url}/v1"}}
  simserver: {{type: vllm, base_url: "{sim_url}/v1"}}
  inproc: {{type: simulated, ttft_ms: 5, tpot_ms: 1, tokens: {TOKENS}}}
models:
  scripted: {{backend: scripted}}
  simserver: {{backend: simserver}}
  inproc: {{backend: inproc}}
tenants:
  acme: {{keys: ["{KEY_HASH}"]}}
telemetry: {{otlp_endpoint: "{receiver.url}", service_name: sluice-usage}}
plugins: [auth]
"""
        with gateway_thread(yaml) as gw:
            yield gw, up, receiver, sim_url
    receiver.close()


def stream(base_url: str, model: str, include_usage: bool | None, rid: str) -> list[Any]:
    client = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0)
    options: Any = {"include_usage": include_usage} if include_usage is not None else openai.NOT_GIVEN
    chunks = client.chat.completions.create(
        model=model, messages=MESSAGES, stream=True, stream_options=options, extra_headers={"x-request-id": rid}
    )
    return list(chunks)


def content(chunks: list[Any]) -> tuple[str, list[str | None]]:
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices]


@pytest.mark.parametrize("model", ["scripted", "simserver", "inproc"])
def test_streams_report_usage_whether_the_client_asked_or_not(
    setup: tuple[RunningGateway, ScriptedUpstream, OtlpReceiver, str], model: str
) -> None:
    gw, up, receiver, sim = setup
    direct_url = {"scripted": f"{up.url}/v1", "simserver": f"{sim}/v1"}.get(model)

    plain = stream(gw.base_url, model, None, f"{model}-plain")
    assert all(c.usage is None for c in plain)
    assert all(c.choices for c in plain)  # no usage-only chunk
    asked = stream(gw.base_url, model, True, f"{model}-asked")
    with_usage = [c for c in asked if c.usage is not None]
    assert len(with_usage) == 1
    assert asked[-1] is with_usage[0]
    assert asked[-1].choices == []
    assert with_usage[0].usage.completion_tokens == TOKENS
    assert content(plain) == content(asked[:-1])
    if direct_url is not None:
        # The same stream as straight from the upstream, asked the same way.
        direct = stream(direct_url, model, None, "direct")
        assert content(direct) == content(plain)
        assert len(direct) == len(plain)
        assert [c.usage for c in direct] == [c.usage for c in plain]
    if model == "scripted":
        sent = [r.json for r in up.requests if r.path.endswith("/chat/completions")]
        assert [body.get("stream_options") for body in sent[:2]] == [{"include_usage": True}] * 2

    for rid in (f"{model}-plain", f"{model}-asked"):

        def answered(spans: list[Span], rid: str = rid) -> bool:
            return any(s.attributes.get("sluice.request_id") == rid for s in spans)

        spans = receiver.wait(answered)
        (root,) = [s for s in spans if s.attributes.get("sluice.request_id") == rid]
        (call,) = [s for s in spans if s.trace_id == root.trace_id and s.name == f"chat {model}"]
        assert call.attributes["gen_ai.usage.output_tokens"] == TOKENS
        assert call.attributes["sluice.usage_source"] == "upstream"
        assert root.attributes["sluice.tpot_ms"] > 0

    found = scrape(gw)
    labels = {"tenant": "acme", "model": model}
    assert metric(found, "sluice_tokens_total", direction="output", **labels) == 2 * TOKENS
    assert metric(found, "sluice_tokens_total", direction="input", **labels) > 0
    assert metric(found, "sluice_time_per_output_token_seconds_count", stream="true", **labels) == 2
