"""The latency console's recording cost: instructions per `Ring.record`, counted by callgrind on its own.

The gateway's counts per request (tools/bench/instructions.py) swing by a few thousand instructions between
runs with the clock-driven work around them, more than the ring costs; so the ring is counted apart, to within
a few hundred instructions: a Python process records prepared requests in a loop under callgrind, once with
`Ring.record` and once with a call that does nothing, each at two loop lengths. The difference of the lengths
cancels start-up; the difference of the two calls cancels the loop. What is left is the record itself: its
fields written into its slot. Prepared requests are as the pipeline leaves a streamed chat completion (six
stages, one try, a label, usage as OpenAI reports it, details and all).

`python -m tools.bench.ring` prints the count; `python -m tools.bench.ring run on|off N` is the counted loop.
"""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gateway.context import Exchange, Target
from gateway.plugin import Outcome
from gateway.server.collector import NEVER
from gateway.settings import ModelSettings
from gateway.simulation.answers import Profile
from gateway.telemetry.console import Ring
from gateway.telemetry.durations import server_timing
from gateway.upstream.providers.simulated import SimulatedProvider

LOOPS = (12_000, 22_000)  # both past the ring's 10,000: it is full, and each record lets the oldest go
REQUESTS = 1000  # distinct prepared requests, recorded in turn
COLLECTED = re.compile(rb"Collected : (\d+)")


# What the pipeline leaves in `served`: a real Target (a compiled Exchange checks the class of what it holds).
SERVED = Target("chat", "sim", "chat", ModelSettings(backend="sim"), SimulatedProvider(Profile(), "sim"))


def prepared(i: int) -> tuple[Exchange, Outcome]:
    body = {"model": "chat", "messages": [], "stream": True}
    ex = Exchange(f"{i:032x}", "chat/completions", [], b"{}", body, time.perf_counter())
    ex.served = SERVED
    ex.timings = [("parse", 0.1), ("auth", 0.01), ("rate_limit", 0.01), ("cache", 0.2), ("pool", 0.0)]
    ex.timings.append(("upstream", 48.0))
    ex.upstream_ms = 48.0
    ex.overhead_ms = 0.5
    ex.attempts = [("chat", 48.0, 0)]
    ex.labels = {"cache": "miss"}
    ex.server_timing = server_timing(ex.timings, ex.overhead_ms)  # as the pipeline leaves it with the head
    usage = {  # as OpenAI reports it: with its details, counts nested in dicts
        "prompt_tokens": 10,
        "completion_tokens": 20,
        "total_tokens": 30,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
    }
    return ex, Outcome(status=200, complete=True, ttft_ms=60.0, tpot_ms=5.0, total_ms=200.0, usage=usage)


def run(mode: str, loops: int) -> None:
    ring = Ring(10_000, 64 << 20)
    requests = [prepared(i) for i in range(REQUESTS)]
    # The gateway's collection schedule (server/collector.py): what exists is frozen, the oldest generation is
    # never collected while requests run.
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, NEVER)
    record = ring.record if mode == "on" else Nothing().record
    for i in range(loops):
        ex, outcome = requests[i % REQUESTS]
        record(ex, outcome, 200.0)


class Nothing:
    def record(self, ex: Exchange, outcome: Outcome, total_ms: float) -> None:
        pass


def counted(mode: str, loops: int) -> int:
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "callgrind.out"
        command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
        command += [sys.executable, "-m", "tools.bench.ring", "run", mode, str(loops)]
        done = subprocess.run(command, capture_output=True, check=True, cwd=Path(__file__).resolve().parents[2])
        found = COLLECTED.search(done.stderr)
        if found is None:
            raise RuntimeError(f"callgrind printed no count: {done.stderr[-500:]!r}")
        return int(found.group(1))


def records() -> tuple[int, int]:
    """(instructions, records): what `records` calls of `Ring.record` add, beyond a call that does nothing."""
    short, long = LOOPS
    on = counted("on", long) - counted("on", short)
    off = counted("off", long) - counted("off", short)
    return on - off, long - short


def main(argv: list[str]) -> None:
    if argv[:1] == ["run"]:
        run(argv[1], int(argv[2]))
        return
    instructions, n = records()
    print(f"Ring.record: {instructions / n:,.0f} instructions per request")


if __name__ == "__main__":
    main(sys.argv[1:])
