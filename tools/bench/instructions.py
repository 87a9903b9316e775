"""`sluice bench --scenario instructions`: the instructions the gateway executes per request, counted by callgrind.

CPU time per request moves by ±15 % between identical rounds on a shared VM, more than most changes to a stage;
the instructions a request costs repeat to within a fraction of a percent. So each configuration's gateway runs
under `valgrind --tool=callgrind --instr-atstart=no` (counting off while it starts), is warmed up with
`warmup` requests, and counting is switched on (`callgrind_control -i on`) for `requests` non-stream cache
misses, `concurrency` in flight, then off again and the count dumped. The helpers (the simulated upstream,
Redis, the OTLP sink) and this load client run natively, outside the count.

Configurations: bare (no plugins), each stage added alone (auth, rate_limit, cache, slo, tracing at 0.1,
admission with a capacity never reached, cascade with the small model's answer passing its checks), every stage
but admission and cascade on (`full`); and `messages`: the bare gateway
sent the same requests on Anthropic's Messages API, so that the translation's cost is its own line. Each gateway
is started from this source tree's own directory (`python -m` puts the working directory first on `sys.path`, so
a gateway started elsewhere would run whatever tree is there), and the harness checks where it runs before it
counts.

The CI budget (tests/integration/gateway/test_budget.py, bench/budget.toml) counts bare, full and bare with
admission the same way.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

import orjson
import yaml

from gateway.upstream.pool import Pool
from plugins.auth.keys import new_key
from tools.bench.fleet import (
    BenchError,
    Child,
    free_port,
    run_loop,
    spawn,
    start_redis,
    start_sim,
    start_sink,
    wait_redis,
)
from tools.bench.load import CLIENT_LIMITS, JSON_HEADERS, Workload, send_all, unique_workload, wait_ready

T = TypeVar("T")
NAME = "instructions"
TREE = Path(__file__).resolve().parents[2]  # the source tree whose gateway is counted
STAGES = ("auth", "rate_limit", "cache", "slo", "tracing", "admission", "cascade")
PLUGINS = ("auth", "rate_limit", "cache", "slo", "admission", "cascade")  # in the order the pipeline runs them
BARE: tuple[str, ...] = ()
FULL = STAGES[:5]  # the stages every request of a typical deployment passes (admission has its own line)
ADMISSION = ("admission",)
# Each configuration's stages: bare, each stage added alone, every stage on; and `messages`, the bare gateway
# sent the same prompts as Anthropic Messages requests (translated to chat completions and back).
MESSAGES = "messages"
CONFIGURATIONS: dict[str, tuple[str, ...]] = {
    "bare": BARE,
    **{f"+{s}": (s,) for s in STAGES},
    "full": FULL,
    # The cache's presence filter (cache.presence): a miss skips its Redis GET, and the gateway hears its own stores.
    "+presence": ("cache", "presence"),
    "full+presence": (*FULL, "presence"),
    MESSAGES: BARE,
}
MESSAGES_PATH = b"/v1/messages"
MESSAGES_ANSWER = re.compile(rb'"text_delta"|"type":"text"')
TOKENS = 5
SAMPLE_RATIO = 0.1  # tracing's sample ratio, and the share of the load's traceparents that are sampled
SAMPLE_EVERY = round(1 / SAMPLE_RATIO)
# The span export's thread sends a batch every 5 s or once 512 spans wait (OTEL_BSP_*): on the clock, so a window of
# 300 requests held none or one by chance, up to +45k instructions a request from run to run (a batch of 512 spans
# sent to the sink counted ~13M). The counted gateway holds its encoded spans until it stops instead: what is
# counted is the request path and the completion task (the spans laid out and encoded), never the export, which
# `sluice bench --scenario tracing` times.
HOLD_SPANS = {
    "OTEL_BSP_SCHEDULE_DELAY": "3600000",
    "OTEL_BSP_MAX_QUEUE_SIZE": "1000000",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "1000000",
}
START_TIMEOUT_S = 180.0  # a gateway starts many times slower under valgrind than natively
CONTROL_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class Counting:
    requests: int = 1500
    warmup: int = 300
    concurrency: int = 32


@dataclass(frozen=True, slots=True)
class Count:
    name: str
    stages: tuple[str, ...]
    requests: int
    instructions: int  # executed by the gateway process while counting was on
    build: str = ""  # "compiled" or "pure": which build of the request path the gateway ran (see `build_of`)

    @property
    def per_request(self) -> float:
        return self.instructions / self.requests


def missing_tools() -> str | None:
    """Why callgrind cannot run here, or None when it can."""
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            return f"{tool} not found (Debian: apt-get install valgrind)"
    return None


def gateway_config(stages: Sequence[str], ports: dict[str, int], key_hash: str) -> dict[str, object]:
    """The bare gateway's config (bench/scenarios/overhead.yaml's shape) with `stages` added as full.yaml has them."""
    tenant = "bench" if "auth" in stages else "anonymous"  # without auth every caller is tenant "anonymous"
    config: dict[str, object] = {
        "listen": {"host": "127.0.0.1", "port": ports["gateway"]},
        "backends": {"fast": {"type": "openai", "base_url": f"http://127.0.0.1:{ports['fast']}/v1"}},
        "pool": {"warm_connections": 8, "keepalive": 64},
        "plugins": [p for p in PLUGINS if p in stages],
    }
    models: dict[str, object] = {"fast": {"backend": "fast"}}
    if "slo" in stages:
        slo = {"ttft_p95_ms": 2000, "max_error_rate": 0.5}
        models = {"fast": {"backend": "fast", "fallback": ["fast-standby"], "slo": slo}}
        models["fast-standby"] = {"backend": "fast", "upstream_model": "fast"}
    config["models"] = models
    tenants: dict[str, dict[str, object]] = {}
    if "auth" in stages:
        tenants[tenant] = {"keys": [key_hash]}
    if "rate_limit" in stages:
        limits = {"requests_per_minute": 10_000_000, "tokens_per_minute": 10_000_000_000}
        tenants.setdefault(tenant, {})["rate_limit"] = limits
    if tenants:
        config["tenants"] = tenants
    if "rate_limit" in stages or "cache" in stages:
        config["redis"] = {"url": f"redis://127.0.0.1:{ports['redis']}/0"}
    if "cache" in stages:
        cache: dict[str, object] = {"mode": "always"}  # every request below is a prompt never sent before: a miss
        if "presence" in stages:
            cache["presence"] = True
        config["cache"] = cache
    if "cascade" in stages:
        # The small model first, its answer passing: the same upstream under another name, whose answers the
        # checks pass (`length` left out: the workload's max_tokens cuts every answer).
        cascade = {"small": "fast-small", "checks": ["empty", "json", "tool_args"]}
        models["fast"] = {**models["fast"], "cascade": cascade}  # type: ignore[dict-item]
        models["fast-small"] = {"backend": "fast", "upstream_model": "fast"}
    if "admission" in stages:
        # A capacity far above the load: every request classified and through the gate, none ever waits.
        config["admission"] = {"backends": {"fast": {"max_in_flight": 100_000}}}
    if "tracing" in stages:
        config["telemetry"] = {"otlp_endpoint": f"http://127.0.0.1:{ports['sink']}", "sample_ratio": SAMPLE_RATIO}
    return config


@dataclass(slots=True)
class Helpers:
    """The native processes every counted gateway talks to, started once."""

    workdir: Path
    ports: dict[str, int]
    key: str
    key_hash: str
    children: list[Child] = field(default_factory=list)

    def stop(self) -> None:
        for child in self.children:
            child.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


@contextlib.asynccontextmanager
async def helpers(stages: Sequence[str]) -> AsyncIterator[Helpers]:
    """The simulated upstream, and Redis and an OTLP sink where `stages` need them, running natively."""
    key, key_hash = new_key()
    env = dict(os.environ)
    found = Helpers(Path(tempfile.mkdtemp(prefix="sluice-callgrind-")), {"fast": free_port()}, key, key_hash)
    try:
        sim = start_sim("fast", found.ports["fast"], 0.0, TOKENS, None, env)
        found.children.append(sim)
        ready = [(sim, "fast", b"/health")]
        deadline = time.monotonic() + 30.0
        if {"rate_limit", "cache"} & set(stages):
            found.ports["redis"] = free_port()
            redis = start_redis(found.ports["redis"], None, env)
            found.children.append(redis)
            await wait_redis(redis, found.ports["redis"], deadline)
        if "tracing" in stages:
            found.ports["sink"] = free_port()
            sink = start_sink("otlp sink", found.ports["sink"], None, env)
            found.children.append(sink)
            ready.append((sink, "sink", b"/stats"))
        for child, port_name, path in ready:
            pool = Pool(f"http://127.0.0.1:{found.ports[port_name]}", CLIENT_LIMITS)
            try:
                await wait_ready(child, pool, path, deadline)
            finally:
                await pool.aclose()
        yield found
    finally:
        found.stop()


def control(pid: int, *args: str) -> None:
    """One callgrind_control command to the gateway under valgrind, waited for."""
    done = subprocess.run(
        ["callgrind_control", *args, str(pid)], capture_output=True, timeout=CONTROL_TIMEOUT_S, check=False
    )
    if done.returncode != 0 or b"OK" not in done.stdout:
        raise BenchError(f"callgrind_control {' '.join(args)} failed: {(done.stdout + done.stderr).decode()[-500:]}")


def dumps(directory: Path) -> set[Path]:
    return set(directory.glob("callgrind.out*"))


def dumped_total(directory: Path, before: set[Path]) -> int:
    """The `totals:` line of the dump callgrind wrote since `before` was listed."""
    deadline = time.monotonic() + CONTROL_TIMEOUT_S
    while True:
        for path in sorted(dumps(directory) - before):
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith("totals:"):
                    return int(line.split()[1])
        if time.monotonic() > deadline:
            raise BenchError(f"no callgrind dump appeared in {directory}")
        time.sleep(0.1)


def check_tree(pid: int) -> None:
    """The gateway runs this tree's code: `python -m` started in this tree imports `gateway` from it."""
    cwd = Path(os.readlink(f"/proc/{pid}/cwd")).resolve()
    if cwd != TREE:
        raise BenchError(f"the gateway under callgrind runs from {cwd}, not from {TREE}")


def build_of(pid: int) -> str:
    """ "compiled" when the gateway process has loaded the compiled request path's library (setup.py), else "pure"."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return "compiled" if "_compiled__mypyc" in maps else "pure"


async def count(name: str, stages: Sequence[str], fleet: Helpers, counting: Counting, repeats: int = 1) -> list[Count]:
    """Start the gateway for `stages` under callgrind, warm it, count `repeats` windows of requests, stop it."""
    if (why := missing_tools()) is not None:
        raise BenchError(why)
    ports = {**fleet.ports, "gateway": free_port()}
    workdir = Path(tempfile.mkdtemp(prefix="gateway-", dir=fleet.workdir))
    config = workdir / "config.yaml"
    config.write_text(yaml.safe_dump(gateway_config(stages, ports, fleet.key_hash)))
    valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={workdir}/callgrind.out"]
    serve = [sys.executable, "-m", "gateway.cli", "serve", "-c", str(config), "--log-level", "warning"]
    env = dict(os.environ)
    env.pop("PYTHONSAFEPATH", None)  # -m must put this tree's directory (the working directory) first
    env.update(HOLD_SPANS)
    child = spawn(f"gateway {name} under callgrind", [*valgrind, *serve], None, env, cwd=str(TREE))
    pool = Pool(f"http://127.0.0.1:{ports['gateway']}", CLIENT_LIMITS)
    headers = JSON_HEADERS
    if "auth" in stages:
        headers += b"authorization: Bearer " + fleet.key.encode() + b"\r\n"
    sampled = "tracing" in stages
    counts = []
    try:
        await wait_ready(child, pool, b"/readyz", time.monotonic() + START_TIMEOUT_S)
        check_tree(child.popen.pid)
        build = build_of(child.popen.pid)
        messages = name == MESSAGES
        await load(pool, headers, counting.warmup, counting.concurrency, messages, sampled)
        for _ in range(repeats):
            before = dumps(workdir)
            control(child.popen.pid, "-z")
            control(child.popen.pid, "-i", "on")
            await load(pool, headers, counting.requests, counting.concurrency, messages, sampled)
            control(child.popen.pid, "-i", "off")
            control(child.popen.pid, "-d")
            counts.append(Count(name, tuple(stages), counting.requests, dumped_total(workdir, before), build))
    finally:
        await pool.aclose()
        child.stop()
    return counts


async def load(
    pool: Pool, headers: bytes, requests: int, concurrency: int, messages: bool = False, sampled: bool = False
) -> None:
    """`requests` non-stream prompts never sent before (cache misses), `concurrency` at a time; all must succeed.
    With `messages`, the same prompts as Anthropic Messages requests; with `sampled`, each with a traceparent."""
    work = unique_workload("fast", False, TOKENS, requests, headers)
    if sampled:
        work = replace(work, extra=traceparents(requests))
    if messages:
        made = [orjson.loads(body) for body in work.bodies]
        bodies = tuple(orjson.dumps({**body, "max_tokens": TOKENS}) for body in made)
        work = Workload(MESSAGES_PATH, bodies, False, headers, answer=MESSAGES_ANSWER)
    samples = await send_all(pool, work, concurrency)
    if samples.errors or len(samples.latency) != requests:
        raise BenchError(f"{samples.errors} of {requests} requests failed while counting instructions")


async def measure(counting: Counting, names: Sequence[str] = tuple(CONFIGURATIONS), repeats: int = 1) -> list[Count]:
    """Each named configuration counted in turn, against one set of helpers."""
    stages = sorted({stage for name in names for stage in CONFIGURATIONS[name]})
    found = []
    async with helpers(stages) as fleet:
        for name in names:
            found += await count(name, CONFIGURATIONS[name], fleet, counting, repeats)
    return found


def traceparents(requests: int) -> tuple[bytes, ...]:
    """A W3C traceparent for each request, as an instrumented client sends, every `SAMPLE_EVERY`th sampled.

    A sampled request costs the gateway ~390k instructions more than one that is not (its spans laid out,
    encoded and exported), so with trace ids drawn at random the 10 % a window samples (30 of 300, give or take
    5) swung the count by ±7k a request from run to run; under a parent's decision every window samples the
    same share: exactly one request in `SAMPLE_EVERY`, the ratio the config names for requests without one.
    """
    tag = uuid.uuid4().hex[:16].encode()
    flags = [b"01" if i % SAMPLE_EVERY == 0 else b"00" for i in range(requests)]
    return tuple(b"traceparent: 00-%s%016x-%016x-%s\r\n" % (tag, i + 1, i + 1, flag) for i, flag in enumerate(flags))


def markdown(counts: Sequence[Count], counting: Counting, command: str, seconds: float) -> str:
    by_name = {c.name: c for c in counts}
    bare = by_name.get("bare")
    lines = [
        "# Sluice benchmark: instructions per request",
        "",
        f"- Command: `{command}` ({seconds:.0f} s); build: {', '.join(sorted({c.build for c in counts}))}",
        f"- The gateway under `valgrind --tool=callgrind --instr-atstart=no`, {counting.warmup} requests to warm it,"
        f" then counting on for {counting.requests} non-stream cache misses, {counting.concurrency} in flight;"
        " the simulated upstream, Redis, the OTLP sink and the load client run natively",
        "",
        "| configuration | thousands of instructions per request | over bare |",
        "|---|---|---|",
    ]
    for c in counts:
        over = f"+{(c.per_request - bare.per_request) / 1000:,.0f}" if bare is not None and c is not bare else ""
        lines.append(f"| {c.name} | {c.per_request / 1000:,.0f} | {over} |")
    if bare is not None and "full" in by_name:
        lines += ["", f"- Share bare / full: {100 * bare.per_request / by_name['full'].per_request:.1f} %"]
    return "\n".join([*lines, ""])


def main(preset: str, command: str, write: str | None) -> int:
    """Count every configuration, print the table, write it with --write; 2 when it could not run."""
    counting = Counting(requests=200, warmup=50, concurrency=8) if preset == "smoke" else Counting()
    started = time.perf_counter()
    try:
        counts = run_loop(measure(counting))
    except BenchError as exc:
        print(f"sluice bench: {exc}", file=sys.stderr)
        return 2
    text = markdown(counts, counting, command, time.perf_counter() - started)
    print(text, end="")
    if write:
        Path(write).write_text(text)
    return 0
