"""The two builds of the request path (setup.py): pure Python (the default) and compiled with mypyc (SLUICE_COMPILE=1).

The suite runs whichever build is installed, and the request path's own tests run again here in a subprocess on
the other one: on the compiled build (the `compiled_tree` fixture: its extensions built once per set of sources,
cached outside the checkout, tests/support/compiled.py) where the install is pure, as CI's is, or with
SLUICE_PURE=1 where the install is compiled, so that the sources, which stay the truth and the fallback, are
tested too. Those tests: the wire marks, the relay and the HTTP/1.1 protocol byte for byte, the RESP client, the
pool, the proxy end to end, the Messages API's translation, the admission stage, and the rate limiter's and
cache's stages.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gateway
from tools.bench.instructions import TREE

REQUEST_PATH_TESTS = (
    "tests/unit/gateway/wire",
    "tests/unit/gateway/server/test_relay.py",
    "tests/unit/gateway/server/test_protocol.py",
    "tests/unit/gateway/state/test_resp.py",
    "tests/unit/gateway/upstream/test_pool.py",
    "tests/unit/plugins/test_rate_limit.py",
    "tests/unit/plugins/test_cache_memory.py",
    "tests/integration/gateway/test_proxy.py",
    "tests/integration/plugins/test_cache.py",
    "tests/integration/plugins/test_cache_presence.py",
    "tests/integration/plugins/test_rate_limit.py",
    "tests/integration/gateway/test_messages.py",
    "tests/integration/plugins/test_admission.py",
    "tests/integration/plugins/test_auth.py",
    "tests/unit/plugins/test_slo.py",
    "tests/integration/plugins/test_slo.py",
    "tests/integration/gateway/test_backends.py",
    "tests/integration/gateway/test_routing.py",
    "tests/integration/gateway/test_console.py",
    "tests/integration/gateway/test_telemetry.py",
    "tests/integration/gateway/test_websocket.py",
    "tests/integration/gateway/test_client_limits.py",
    "tests/integration/gateway/test_input.py",
    "tests/integration/gateway/test_descriptors.py",
    "tests/integration/gateway/test_store.py",
    "tests/unit/gateway/telemetry/test_metric_batches.py",
)
RUN_TIMEOUT_S = 1200.0


def compiled_modules() -> list[str]:
    return [gateway.module_of(source) for source in gateway.compiled_sources()]


def origins(pure: bool) -> dict[str, str]:
    """Where each compiled module is imported from, in a fresh interpreter (SLUICE_PURE=1 with `pure`)."""
    env = {**os.environ, "SLUICE_PURE": "1"} if pure else {k: v for k, v in os.environ.items() if k != "SLUICE_PURE"}
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    print(name, importlib.import_module(name).__file__)"
    command = [sys.executable, "-c", script, *compiled_modules()]
    out = subprocess.run(command, env=env, cwd=TREE, capture_output=True, text=True, check=True).stdout
    return dict(line.split(" ", 1) for line in out.splitlines())


def test_compiled_modules_are_the_extensions() -> None:
    if not gateway.compiled():
        pytest.skip(f"this install runs the request path pure ({gateway.BYPASSED or 'nothing was compiled'})")
    found = origins(pure=False)
    assert found
    assert all(".so" in path or ".pyd" in path for path in found.values()), found
    assert importlib.import_module("gateway.state.resp").__file__ == found["gateway.state.resp"]


def run_tests(tree: Path, env: dict[str, str], *tests: str) -> None:
    """`tests` run by pytest in a fresh interpreter started in `tree` (so importing `gateway` from it)."""
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    run = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_request_path_compiled(compiled_tree: Path) -> None:
    if gateway.compiled():
        pytest.skip("this install is the compiled build: the whole suite ran the request path compiled")
    env = {k: v for k, v in os.environ.items() if k != "SLUICE_PURE"}
    here = "tests/integration/gateway/test_builds.py::test_compiled_modules_are_the_extensions"
    run_tests(compiled_tree, env, here, *REQUEST_PATH_TESTS)


def test_request_path_in_pure_python() -> None:
    if not gateway.compiled_sources():
        pytest.skip("nothing was compiled: the whole suite runs the request path pure")
    found = origins(pure=True)
    assert all(path.endswith(".py") for path in found.values()), found
    run_tests(TREE, {**os.environ, "SLUICE_PURE": "1"}, *REQUEST_PATH_TESTS)
