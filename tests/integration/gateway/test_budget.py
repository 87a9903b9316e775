"""The CI budget: instructions per request for the bare path and for every stage on, against bench/budget.toml.

Timings on a shared machine swing by ±15 % between identical rounds, so they cannot catch a 5 % regression;
the instructions the gateway executes per request repeat to within about a percent, and can. Each gateway
runs under callgrind (tools/bench/instructions.py) with its helpers native.

Both builds of the request path have their own budget (bench/budget.toml): `compiled` (the modules setup.py
compiles with mypyc) and `pure` (their Python sources: the default install, or SLUICE_PURE=1). Where the install
is pure, as CI's is, the compiled count runs in a copy of the checkout with the compiled extensions in place
(the `compiled_tree` fixture). Each count says which build the gateway ran (the library it loaded), and the test
checks that it is the one it means to count.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import gateway
from tools.bench import ring as bench_ring
from tools.bench.fleet import run_loop
from tools.bench.instructions import (
    ADMISSION,
    BARE,
    FULL,
    MESSAGES,
    TREE,
    Count,
    Counting,
    count,
    helpers,
    missing_tools,
)

BUDGET = TREE / "bench" / "budget.toml"
# How the budget was counted (see its file): change both together.
COUNTING = Counting(requests=300, warmup=100, concurrency=16)
# Set by .ci/run when valgrind cannot be installed on the machine: the one case where this test skips.
UNAVAILABLE = "SLUICE_VALGRIND_UNAVAILABLE"
RUN_TIMEOUT_S = 1800.0


BUILDS = ("compiled", "pure")


def budget(build: str) -> tuple[float, dict[str, int]]:
    data = tomllib.loads(Path(BUDGET).read_text())
    table = data["instructions_per_request"] if build == "pure" else data["instructions_per_request_compiled"]
    return float(data["tolerance"]), {name: int(value) for name, value in table.items()}


def counted() -> list[Count]:
    async def both() -> list[Count]:
        async with helpers(FULL) as fleet:
            return [
                *await count("bare", BARE, fleet, COUNTING),
                *await count("full", FULL, fleet, COUNTING),
                *await count(MESSAGES, BARE, fleet, COUNTING),
                *await count("admission", ADMISSION, fleet, COUNTING),
            ]

    # The console's recording, counted on its own (tools/bench/ring.py): to within a few hundred instructions,
    # where the gateway's counts swing by more than it costs.
    instructions, records = bench_ring.records()
    return [*run_loop(both()), Count("console", (), records, instructions)]


def check_tools() -> None:
    why = missing_tools()
    if why is not None:
        if os.environ.get(UNAVAILABLE):
            pytest.skip(f"{why}; valgrind could not be installed here: {os.environ[UNAVAILABLE]}")
        pytest.fail(f"{why}: the instruction budget cannot be checked (set {UNAVAILABLE}=reason to skip)")


def test_compiled_build_within_budget(request: pytest.FixtureRequest) -> None:
    """Where this install is pure: the compiled table, counted in the compiled copy of the checkout."""
    check_tools()
    if gateway.compiled():
        pytest.skip("this install is the compiled build: counted by the test below in this process")
    tree: Path = request.getfixturevalue("compiled_tree")
    test = "tests/integration/gateway/test_budget.py::test_instructions_per_request_within_budget[compiled]"
    env = {k: v for k, v in os.environ.items() if k != "SLUICE_PURE"}
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", test]
    run = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout, run.stdout[-2000:]
    print(next(line for line in run.stdout.splitlines() if line.startswith("instructions per request")))


@pytest.mark.parametrize("build", BUILDS)
def test_instructions_per_request_within_budget(build: str, monkeypatch: pytest.MonkeyPatch) -> None:
    check_tools()
    if build == "compiled" and not gateway.compiled():
        pytest.skip("this install runs the request path pure: test_compiled_build_within_budget counts the compiled")
    if build == "pure":
        monkeypatch.setenv("SLUICE_PURE", "1")  # the gateway under callgrind inherits it
    tolerance, budgets = budget(build)
    counts = counted()
    assert {c.build for c in counts if c.name != "console"} == {build}, "the gateway did not run the build counted"
    found = {c.name: c.per_request for c in counts}
    report = ", ".join(f"{name} {found[name]:,.0f} (budget {budgets[name]:,})" for name in budgets)
    over = [name for name, limit in budgets.items() if found[name] > limit * (1 + tolerance)]
    assert not over, f"{build}: instructions per request over budget by more than {tolerance:.0%}: {report}"
    print(f"instructions per request, {build}: {report}")
