"""The scenarios that run their own processes rather than the shared rig: `workers` and `streams`.

Each starts the gateway it measures the way it needs (several workers; one worker holding thousands of
streams, with a load generator in a process of its own), unpinned, so it cannot share the rig's gateways
or its pinned CPUs. Their page follows the rig's, with its own targets table.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from tools.bench import streams as bench_streams
from tools.bench import workers as bench_workers
from tools.bench.figures import Check, targets
from tools.bench.fleet import machine
from tools.bench.rig import BenchOptions
from tools.bench.streams import Streams
from tools.bench.workers import Workers

OWN_PROCESSES = ("workers", "streams")


@dataclass(frozen=True, slots=True)
class ScaleReport:
    options: BenchOptions
    date: str
    machine: str
    seconds: float
    workers: Workers | None
    streams: Streams | None

    @property
    def errors(self) -> int:
        return sum(part.errors for part in (self.workers, self.streams) if part is not None)

    @property
    def checks(self) -> list[Check]:
        found = bench_workers.checks(self.workers) if self.workers is not None else []
        return found + (bench_streams.checks(self.streams) if self.streams is not None else [])

    def markdown(self) -> str:
        lines = [
            "# Sluice benchmark: workers and streams",
            "",
            f"- Command: `{self.options.command}`",
            f"- Date: {self.date}; these scenarios took {self.seconds:.0f} s",
            f"- Machine: {self.machine}",
            "- Placement: unpinned (every process may use every CPU)",
            "",
            *targets(self.checks),
        ]
        if self.workers is not None:
            lines += [*bench_workers.render(self.workers), ""]
        if self.streams is not None:
            lines += [*bench_streams.render(self.streams), ""]
        load = os.getloadavg()
        lines += [f"- Load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", ""]
        return "\n".join(lines)


async def measure(options: BenchOptions) -> ScaleReport:
    started = time.perf_counter()
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    about = machine()
    env = dict(os.environ)
    names = options.scenarios
    workers = await bench_workers.measure(options, env) if "workers" in names else None
    streams = await bench_streams.measure(options, env) if "streams" in names else None
    return ScaleReport(options, date, about, time.perf_counter() - started, workers, streams)
