"""`sluice probe URL`: where the latency floor of an OpenAI-compatible endpoint comes from.

It sends three chat probes (minimal, medium, long), streamed and not, on new and on kept-alive connections,
and times every phase of each request with its own client (probe_client). The very first request is kept
apart as the cold one; then one warm-up per probe, then N rounds of samples, interleaved so that drift in the
endpoint touches every kind of request alike. With `--via GATEWAY` the same requests also go through a gateway
and the two sides are compared stage by stage. The figures (probe_summary) go through the troubleshooting
table (probe_diagnosis) and out as a text report and, with `--json`, a JSON document (probe_report).

Requests run one at a time on purpose: the probe measures the floor, not throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httptools

from tools.probe.client import Connection, Endpoint, ProbeError, Sample, model_ids, tls_context
from tools.probe.diagnosis import diagnose
from tools.probe.report import Report, render
from tools.probe.summary import KINDS, compare, summarise

FAILURES = (OSError, TimeoutError, ProbeError, httptools.HttpParserError)
_TOPIC = (
    "A sluice is a water channel controlled at its head by a gate.",
    "Mills once used sluices to bring a steady flow of water to the wheel.",
    "Engineers size the gate so that the flow stays calm even when the river rises after rain.",
    "Every gate adds a little resistance, and the art is to keep that resistance small.",
    "Operators watch the level upstream and open the gate before the water backs up.",
    "A well kept sluice passes water the moment it arrives and holds nothing back.",
)


@dataclass(frozen=True, slots=True)
class Probe:
    name: str
    prompt: str
    max_tokens: int


def _context(sentences: int) -> str:
    return " ".join(f"({i + 1}) {_TOPIC[i % len(_TOPIC)]}" for i in range(sentences))


# The long probe also carries a long prompt (~1,000 tokens), so that its TTFT shows the cost of prefill.
PROBES = {
    probe.name: probe
    for probe in (
        Probe("minimal", "Say ok", 2),
        Probe("medium", f"{_context(4)}\n\nIn about 20 words, say what a sluice does.", 24),
        Probe("long", f"{_context(48)}\n\nIn about 100 words, summarise the text above.", 110),
    )
}


@dataclass(frozen=True, slots=True)
class Options:
    direct: Endpoint
    via: Endpoint | None
    model: str | None
    via_model: str | None
    samples: int
    timeout: float
    probes: tuple[str, ...]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Options:
        if args.samples < 1:
            raise ValueError("--samples must be at least 1")
        if args.timeout <= 0:
            raise ValueError("--timeout must be positive")
        probes = tuple(name.strip() for name in args.probes.split(",") if name.strip())
        unknown = [name for name in probes if name not in PROBES]
        if unknown or not probes:
            raise ValueError(f"--probes takes names from {', '.join(PROBES)}; got {args.probes!r}")
        if "minimal" not in probes:
            probes = ("minimal", *probes)  # the floor and the cold request are measured with it
        via_key = args.via_key if args.via_key is not None else args.key
        return cls(
            Endpoint.parse(args.url, args.key),
            Endpoint.parse(args.via, via_key) if args.via else None,
            args.model,
            args.via_model,
            args.samples,
            args.timeout,
            probes,
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "url": self.direct.url,
            "via": None if self.via is None else self.via.url,
            "model": self.model,
            "via_model": self.via_model,
            "samples": self.samples,
            "timeout_s": self.timeout,
            "probes": list(self.probes),
        }


def describe(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"no complete answer within {timeout:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    return str(exc) or type(exc).__name__


class Side:
    """One endpoint under test ("direct", or "via" the gateway): its model and its kept-alive connection."""

    def __init__(self, name: str, endpoint: Endpoint, model: str | None, timeout: float) -> None:
        self.name = name
        self.endpoint = endpoint
        self.model = model or ""
        self.timeout = timeout
        self.context = tls_context()
        self.kept: Connection | None = None
        self.ever_kept = False
        self.reuse_planned = 0
        self.reuse_lost = 0
        self.token_field = "max_tokens"

    async def discover(self) -> None:
        """The first model of `GET /models`, when none was given."""
        scratch = Sample(self.name, "models", False, "fresh", "discovery")
        async with asyncio.timeout(self.timeout):
            conn = await Connection.open(self.endpoint, self.context, scratch, time.perf_counter())
            try:
                status, body = await conn.fetch(self.endpoint.request("GET", "/models", None, False))
            finally:
                await conn.close()
        ids = model_ids(body) if status == 200 else []
        if not ids:
            raise ProbeError(f"HTTP {status}, no model listed" if status == 200 else f"HTTP {status}")
        self.model = ids[0]

    async def cold(self) -> Sample:
        sample = await self.request(PROBES["minimal"], True, "fresh", "cold")
        # Newer OpenAI models refuse max_tokens and name its replacement: switch once and measure again.
        if sample.status == 400 and "max_completion_tokens" in (sample.error or ""):
            self.token_field = "max_completion_tokens"
            sample = await self.request(PROBES["minimal"], True, "fresh", "cold")
        return sample

    async def request(self, probe: Probe, stream: bool, want: str, role: str) -> Sample:
        conn = await self._take() if want == "reused" else None
        sample = Sample(self.name, probe.name, stream, "reused" if conn is not None else "fresh", role)
        body = json.dumps(
            {
                "model": self.model,
                "messages": [{"role": "user", "content": probe.prompt}],
                self.token_field: probe.max_tokens,
                "stream": stream,
            }
        ).encode()
        keep = False
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout):
                if conn is None:
                    conn = await Connection.open(self.endpoint, self.context, sample, start)
                request = self.endpoint.request("POST", "/chat/completions", body, stream)
                keep = await conn.exchange(request, sample, start)
        except FAILURES as exc:
            sample.error = describe(exc, self.timeout)
        if conn is not None:
            if keep and want == "reused":
                self.kept, self.ever_kept = conn, True
            else:
                await conn.close()
        return sample

    async def _take(self) -> Connection | None:
        conn, self.kept = self.kept, None
        if conn is not None and conn.reader.at_eof():
            await conn.close()  # closed by the server while idle
            conn = None
        if self.ever_kept:
            self.reuse_planned += 1
            self.reuse_lost += conn is None
        return conn

    async def close(self) -> None:
        if self.kept is not None:
            await self.kept.close()
            self.kept = None


class Progress:
    """A request counter on stderr: redrawn in place on a terminal, one dot per request elsewhere."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.tty = out.isatty()
        self.total = 0
        self.done = 0

    def tick(self, label: str) -> None:
        self.done += 1
        if self.tty:
            self.out.write(f"\rprobing {label}: {self.done}/{self.total} requests")
        else:
            self.out.write(".")
        self.out.flush()

    def end(self) -> None:
        if self.done:
            self.out.write("\r\033[K" if self.tty else "\n")
            self.out.flush()


async def run(options: Options, progress: Progress) -> Report:
    """Every request of the probe, in order; the report's samples and failure, not yet summarised."""
    sides = [Side("direct", options.direct, options.model, options.timeout)]
    if options.via is not None:
        sides.append(Side("via", options.via, options.via_model or options.model, options.timeout))
    report = Report(options.as_json())
    try:
        await _sample(options, sides, report, progress)
    finally:
        for side in sides:
            await side.close()
        progress.end()
    _conclude(options, sides, report)
    return report


async def _sample(options: Options, sides: list[Side], report: Report, progress: Progress) -> None:
    for side in sides:
        if side.name == "via" and not side.model:
            side.model = sides[0].model  # the same name through the gateway unless told otherwise
        if side.model:
            continue
        try:
            await side.discover()
        except FAILURES as exc:
            url = side.endpoint.url
            report.failure = f"{side.name}: GET {url}/models failed ({describe(exc, options.timeout)}); pass --model"
            return
    probes = [PROBES[name] for name in options.probes]
    progress.total = len(sides) * (1 + 2 * len(probes) + 4 * options.samples * len(probes))
    for side in sides:
        cold = await side.cold()
        report.samples.append(cold)
        progress.tick(side.name)
        if not cold.ok:
            report.failure = f"{side.name}: the first request failed: {cold.error}"
            return
    for side in sides:
        for probe in probes:
            for stream in (True, False):
                report.samples.append(await side.request(probe, stream, "reused", "warmup"))
                progress.tick(side.name)
    for _ in range(options.samples):
        for side in sides:
            for probe in probes:
                for stream in (True, False):
                    for kind in KINDS:
                        report.samples.append(await side.request(probe, stream, kind, "sample"))
                        progress.tick(side.name)


def _conclude(options: Options, sides: list[Side], report: Report) -> None:
    if any(not side.model for side in sides):
        return
    for side in sides:
        reuse = (side.reuse_planned, side.reuse_lost)
        report.targets.append(
            summarise(side.name, side.endpoint.url, side.model, report.samples, options.probes, reuse)
        )
    if len(report.targets) == 2:
        report.comparison = compare(report.targets[0], report.targets[1])
    if report.failure is None:
        report.findings = diagnose(report.targets, report.comparison)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="base URL of an OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument(
        "--key", metavar="K", help="API key (sent as Authorization: Bearer, or api-key for Azure hosts)"
    )
    parser.add_argument("--model", metavar="M", help="model to probe (default: the first of GET URL/models)")
    parser.add_argument("--via", metavar="GATEWAY_URL", help="also probe through this gateway and compare")
    parser.add_argument("--via-model", metavar="M", help="model name at the gateway (default: the same as direct)")
    parser.add_argument("--via-key", metavar="K", help="API key for the gateway (default: --key)")
    parser.add_argument("--samples", metavar="N", type=int, default=5, help="samples per kind of request (default 5)")
    parser.add_argument(
        "--probes", metavar="LIST", default="minimal,medium,long", help="probes to run (default: all three)"
    )
    parser.add_argument("--timeout", metavar="S", type=float, default=60.0, help="seconds per request (default 60)")
    parser.add_argument("--json", metavar="FILE", help="write every sample, the summary and the findings here")
    parser.add_argument("--html", metavar="FILE", help="write the breakdown as a waterfall with the diagnosis here")


def main(args: argparse.Namespace) -> int:
    """Run the probe and print the report; 1 if the endpoint failed, 2 for bad arguments, else 0."""
    try:
        options = Options.from_args(args)
    except ValueError as exc:
        print(f"sluice probe: {exc}", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(run(options, Progress(sys.stderr)))
    except KeyboardInterrupt:
        print("\nsluice probe: interrupted", file=sys.stderr)
        return 130
    text = render(report)
    sys.stdout.write(text)
    sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_json(), indent=2) + "\n")
    if args.html:
        from tools.probe.html import page

        Path(args.html).write_text(page(report.as_json(), text))
    return 0 if report.ok else 1


if __name__ == "__main__":
    cli = argparse.ArgumentParser(prog="sluice probe", description="Where the latency floor of an endpoint comes from.")
    add_arguments(cli)
    sys.exit(main(cli.parse_args()))
