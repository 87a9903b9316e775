"""`sluice probe` against real servers on loopback, each with one cause of latency injected.

Every injected cause must come out as the dominant stage and as the matching finding; a healthy endpoint must
come out with none. The probe runs in-process through its CLI entry points (`add_arguments`, `main`), each run
writing its JSON document, which is checked field by field.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.simulation.answers import Profile
from tests.support.gateway import free_port, gateway_thread
from tests.support.upstream import Buffered, MissingDone, Ok, ScriptedUpstream, Status
from tools.probe.client import Sample
from tools.probe.command import add_arguments, main
from tools.probe.diagnosis import diagnose
from tools.probe.summary import compare, summarise
from tools.sim.server import start_server

# Healthy: a quick model, far enough above loopback noise that a busy test machine cannot reorder its stages.
HEALTHY = Profile(ttft_ms=60.0, tpot_ms=2.0, tokens=12)
SAMPLE_KEYS = {
    "target", "probe", "stream", "connection", "role", "status", "dns_ms", "connect_ms", "tls_ms", "sent_ms",
    "ttfb_ms", "ttft_ms", "tpot_ms", "total_ms", "tokens", "gaps_ms", "server_timing", "overhead_ms", "error",
}  # fmt: skip
FINDING_KEYS = {"target", "code", "cause", "stage", "summary", "advice", "evidence"}


def probe(tmp_path: Path, *argv: str) -> tuple[int, dict[str, Any], str]:
    """Exit code, JSON document and printed report of one in-process run."""
    parser = argparse.ArgumentParser(prog="sluice probe")
    add_arguments(parser)
    path = tmp_path / "probe.json"
    args = parser.parse_args([*argv, "--json", str(path), "--timeout", "10"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(args)
    return code, json.loads(path.read_text()), out.getvalue()


def codes(doc: dict[str, Any]) -> set[str]:
    return {finding["code"] for finding in doc["findings"]}


def finding(doc: dict[str, Any], code: str) -> dict[str, Any]:
    found: dict[str, Any] = next(f for f in doc["findings"] if f["code"] == code)
    assert set(found) == FINDING_KEYS
    assert found["cause"]
    assert found["advice"]
    assert found["evidence"]
    return found


def dominant(doc: dict[str, Any], target: int = 0) -> str:
    floor = doc["targets"][target]["floor"]
    assert floor["dominant"] == max(floor["components"], key=floor["components"].get)
    return str(floor["dominant"])


@contextlib.contextmanager
def sim_server(profile: Profile) -> Iterator[str]:
    """`sluice sim` on a free port, on its own loop in a thread; yields its base URL."""
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(start_server("127.0.0.1", 0, profile))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    finally:

        async def stop() -> None:
            server.close()
            await server.wait_closed()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


class SlowAccept:
    """A TCP proxy that waits before serving each new connection, as a saturated accept loop or a proxy that
    dials its backend per connection does: a new connection costs `delay`, a kept-alive one nothing."""

    def __init__(self, port: int, delay: float) -> None:
        self.target = port
        self.delay = delay
        self.loop = asyncio.new_event_loop()
        self.writers: set[asyncio.StreamWriter] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> str:
        self.server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.thread.start()
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        await asyncio.sleep(self.delay)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self.writers.add(up_writer)
        pipes = (self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        tasks = [asyncio.create_task(pipe) for pipe in pipes]
        self.tasks.update(tasks)
        await asyncio.gather(*tasks)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _stop(self) -> None:
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for writer in self.writers:
            writer.close()
        await self.server.wait_closed()
        await asyncio.sleep(0)


def check_samples(doc: dict[str, Any], probes: int, samples: int, targets: int = 1) -> None:
    """Every request is in the document, with the fields its kind of request must have."""
    rows = doc["samples"]
    assert len(rows) == targets * (1 + 2 * probes + 4 * probes * samples)
    for row in rows:
        assert set(row) == SAMPLE_KEYS
        assert row["error"] is None
        assert row["status"] == 200
        assert row["tokens"] > 0
        assert row["tls_ms"] is None  # plain http
        assert 0 <= row["sent_ms"] <= row["ttfb_ms"] <= row["total_ms"]
        if row["connection"] == "fresh":
            assert 0 <= row["dns_ms"] <= row["connect_ms"] <= row["sent_ms"]
        else:
            assert row["dns_ms"] is None
            assert row["connect_ms"] is None
        if row["stream"]:
            assert row["ttfb_ms"] <= row["ttft_ms"] <= row["total_ms"]
            assert len(row["gaps_ms"]) == row["tokens"] - 1
        else:
            assert row["ttft_ms"] is None
            assert row["tpot_ms"] is None
            assert row["gaps_ms"] == []
    roles = [row["role"] for row in rows]
    assert roles.count("cold") == targets
    assert roles[0] == "cold"
    assert roles.count("warmup") == targets * 2 * probes


def test_a_healthy_endpoint_has_no_finding(tmp_path: Path) -> None:
    with sim_server(HEALTHY) as url:
        code, doc, out = probe(tmp_path, url, "--samples", "2")
    assert code == 0, out
    assert doc["findings"] == [], doc["findings"]
    assert "no problem found" in out
    assert doc["format"] == 1
    assert doc["ok"] is True
    assert doc["failure"] is None
    assert doc["options"] == {
        "url": url, "via": None, "model": None, "via_model": None, "samples": 2, "timeout_s": 10.0,
        "probes": ["minimal", "medium", "long"],
    }  # fmt: skip
    assert doc["comparison"] is None
    check_samples(doc, probes=3, samples=2)
    (target,) = doc["targets"]
    assert target["name"] == "direct"
    assert target["model"] == "sim"
    assert target["errors"] == 0
    # Every reuse after the first warm-up opened the kept connection: 5 warm-ups and 12 samples.
    assert target["keepalive"] == {"planned": 5 + 12, "lost": 0}
    assert len(target["cells"]) == 12
    for cell in target["cells"]:
        assert cell["count"] == 2
        assert cell["errors"] == 0
        assert set(cell["phases"]["total_ms"]) == {"p50", "p90", "max", "n"}
        total = cell["phases"]["total_ms"]
        assert total["p50"] <= total["p90"] <= total["max"]
        assert ("ttft_ms" in cell["phases"]) == cell["stream"]
    long_stream = next(c for c in target["cells"] if c["probe"] == "long" and c["stream"])
    assert long_stream["tokens_p50"] == 12
    assert target["cold"]["role"] == "cold"
    assert target["cold"]["connection"] == "fresh"
    # The simulated model's own time to first token is what dominates, and the report says so.
    assert dominant(doc) == "first_token"
    assert target["floor"]["components"]["first_token"] == pytest.approx(62, abs=15)
    assert target["gateway"] is None  # sluice sim is no gateway: no server-timing
    assert "dominant: first_token" in out
    assert "p90" in out


def test_queueing_before_the_head(tmp_path: Path) -> None:
    with ScriptedUpstream(default=Ok(headers_ms=300)) as up:
        code, doc, out = probe(tmp_path, f"{up.url}/v1", "--samples", "2", "--probes", "minimal")
    assert code == 0, out
    assert codes(doc) == {"queueing"}
    found = finding(doc, "queueing")
    assert found["stage"] == "head"
    assert found["target"] == "direct"
    assert found["evidence"]["head_wait_ms"] >= 290
    assert dominant(doc) == "head"
    assert doc["targets"][0]["model"] == "scripted"  # from GET /models
    check_samples(doc, probes=1, samples=2)


def test_a_buffered_stream(tmp_path: Path) -> None:
    with ScriptedUpstream(default=Buffered(ttft_ms=40, tpot_ms=15, tokens=12)) as up:
        code, doc, out = probe(tmp_path, f"{up.url}/v1", "--samples", "2", "--probes", "minimal")
    assert code == 0, out
    assert codes(doc) == {"buffering"}
    found = finding(doc, "buffering")
    assert found["stage"] == "first_token"
    evidence = found["evidence"]
    assert evidence["ttft_p50_ms"] >= 0.9 * evidence["total_p50_ms"] >= 180
    assert evidence["ttfb_p50_ms"] < 20
    assert evidence["tokens_p50"] == 12
    assert dominant(doc) == "first_token"


def test_a_cold_start(tmp_path: Path) -> None:
    with ScriptedUpstream(default=Ok(ttft_ms=10, tpot_ms=2, tokens=6)) as up:
        up.script(Ok(ttft_ms=800, tpot_ms=2, tokens=6))
        code, doc, out = probe(tmp_path, f"{up.url}/v1", "--model", "m", "--samples", "2", "--probes", "minimal")
    assert code == 0, out
    assert codes(doc) == {"cold_start"}
    evidence = finding(doc, "cold_start")["evidence"]
    assert evidence["cold_ms"] >= 800
    assert evidence["warm_p50_ms"] < 100
    assert dominant(doc) == "cold_start"
    assert doc["targets"][0]["cold"]["ttft_ms"] >= 800
    assert up.requests[0].json["model"] == "m"  # --model: no GET /models before the cold request


def test_slow_new_connections(tmp_path: Path) -> None:
    with ScriptedUpstream(default=Ok(ttft_ms=10, tpot_ms=2, tokens=6)) as up, SlowAccept(up.port, 0.15) as proxy:
        code, doc, out = probe(tmp_path, f"{proxy}/v1", "--samples", "2", "--probes", "minimal")
    assert code == 0, out
    assert codes(doc) == {"connection_reuse"}
    found = finding(doc, "connection_reuse")
    assert found["stage"] == "connection"
    assert 100 <= found["evidence"]["connection_cost_ms"] <= 400
    assert found["evidence"]["handshake_ms"] < 20  # the TCP handshake itself is fast: the wait is after it
    assert "after the handshake" in found["summary"]
    assert dominant(doc) == "connection"
    assert up.connections_opened == 1 + 1 + 1 + 2 * 2  # models, cold, the kept one, two fresh per round


def test_through_sluice(tmp_path: Path) -> None:
    with sim_server(HEALTHY) as url:
        config = f"""
backends:
  up: {{type: openai, base_url: "{url}", api_key: upstream-key}}
pool: {{warm_connections: 1}}
models:
  chat: {{backend: up, upstream_model: sim}}
"""
        with gateway_thread(config) as gw:
            code, doc, out = probe(tmp_path, url, "--via", gw.base_url, "--via-model", "chat", "--samples", "2")
    assert code == 0, out
    assert doc["findings"] == [], doc["findings"]
    check_samples(doc, probes=3, samples=2, targets=2)
    direct, via = doc["targets"]
    assert (direct["name"], direct["model"], via["name"], via["model"]) == ("direct", "sim", "via", "chat")
    assert direct["gateway"] is None
    through = [s for s in doc["samples"] if s["target"] == "via"]
    assert all(s["overhead_ms"] is not None and "upstream" in s["server_timing"] for s in through)
    gateway = via["gateway"]
    assert gateway["overhead_ms_p50"] is not None
    assert gateway["server_timing_p50"]["upstream"] > 0
    assert abs(gateway["outside_ms"]) < 25  # the gateway's account and the client's agree
    comparison = doc["comparison"]
    assert len(comparison["cells"]) == 12
    for row in comparison["cells"]:
        for phase, delta in row["delta_ms"].items():
            assert delta == pytest.approx(row["via_p50"][phase] - row["direct_p50"][phase], abs=0.002)
    headline = next(
        c for c in comparison["cells"] if c["probe"] == "minimal" and c["stream"] and c["connection"] == "reused"
    )
    assert comparison["ttft_overhead_ms"] == headline["delta_ms"]["ttft_ms"]
    assert comparison["reported_overhead_ms"] == gateway["overhead_ms_p50"]
    assert "via minus direct" in out
    assert "x-sluice-overhead-ms" in out


@pytest.mark.parametrize(
    ("behaviour", "error"),
    [
        (Status(401), "HTTP 401"),
        (MissingDone(), "[DONE]"),
    ],
)
def test_a_failing_endpoint_exits_1(tmp_path: Path, behaviour: Ok | Status, error: str) -> None:
    with ScriptedUpstream(default=behaviour) as up:
        code, doc, out = probe(tmp_path, f"{up.url}/v1", "--samples", "1", "--probes", "minimal")
    assert code == 1
    assert doc["ok"] is False
    assert error in doc["failure"]
    assert error in out
    assert doc["findings"] == []
    (cold,) = doc["samples"]
    assert cold["role"] == "cold"
    assert error in cold["error"]


def test_connection_refused_exits_1(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    code, doc, out = probe(tmp_path, url, "--model", "m", "--samples", "1")
    assert code == 1
    assert "connection refused" in out
    assert "connection refused" in doc["failure"]
    assert doc["samples"][0]["error"] == "connection refused"
    code, doc, _ = probe(tmp_path, url)
    assert code == 1
    assert "/models" in doc["failure"]
    assert "--model" in doc["failure"]


def synthetic(probe_name: str, connection: str, ttft: float, gaps: list[float], target: str = "direct") -> Sample:
    """A streamed sample and its non-streamed twin's figures, built by hand for the rules alone."""
    total = ttft + sum(gaps)
    return Sample(target, probe_name, True, connection, "sample", 200, sent_ms=0.2, ttfb_ms=1.0, ttft_ms=ttft,
                  tpot_ms=sum(gaps) / len(gaps), total_ms=total, tokens=len(gaps) + 1, gaps_ms=gaps)  # fmt: skip


def rules(samples: list[Sample], reuse: tuple[int, int] = (0, 0)) -> set[str]:
    probes = ("minimal", "long")
    summary = summarise("direct", "http://x/v1", "m", samples, probes, reuse)
    return {f.code for f in diagnose([summary], None)}


def test_rules_without_a_server() -> None:
    steady = [20.0] * 40
    short = [synthetic("minimal", "reused", 60, [20.0]) for _ in range(3)]
    # A long prompt that takes much longer to its first token: prefill.
    assert rules([*short, *(synthetic("long", "reused", 400, steady) for _ in range(3))]) == {"prefill"}
    assert rules([*short, *(synthetic("long", "reused", 70, steady) for _ in range(3))]) == set()
    # Gaps that are mostly 20 ms with one in five at 120 ms: contention.
    uneven = [120.0 if i % 5 == 0 else 20.0 for i in range(40)]  # 3 samples: 120 gaps
    assert rules([*short, *(synthetic("long", "reused", 70, uneven) for _ in range(3))]) == {"contention"}
    # Most kept-alive connections found closed.
    assert rules(short, reuse=(8, 8)) == {"no_keepalive"}
    # Through a gateway that adds 70 ms before the first token.
    direct = summarise("direct", "http://a/v1", "m", short, ("minimal",), (0, 0))
    slow = [synthetic("minimal", "reused", 130, [20.0], target="via") for _ in range(3)]
    via = summarise("via", "http://b/v1", "m", slow, ("minimal",), (0, 0))
    (found,) = diagnose([direct, via], compare(direct, via))
    assert (found.code, found.stage, found.evidence["added_ttft_ms"]) == ("gateway_overhead", "gateway", 70.0)


def test_the_cli_runs_the_probe(tmp_path: Path) -> None:
    if "probe" not in Path("gateway/cli.py").read_text():
        pytest.skip("`sluice probe` is not wired into gateway/cli.py yet")
    with ScriptedUpstream(default=Ok(ttft_ms=5, tpot_ms=1, tokens=4)) as up:
        result = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "probe", f"{up.url}/v1", "--samples", "1", "--probes", "minimal",
             "--json", str(tmp_path / "cli.json")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "no problem found" in result.stdout
    assert json.loads((tmp_path / "cli.json").read_text())["ok"] is True
