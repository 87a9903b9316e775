"""The compiled hot path: the request path's modules built with mypyc, on request (SLUICE_COMPILE=1).

The Python sources stay the source of truth and the default. `pip install -e .` installs pure Python; with
SLUICE_COMPILE=1 (and mypy, which brings mypyc, in the environment the build runs in:
`SLUICE_COMPILE=1 python3 -m pip install --no-build-isolation -e '.[test]'`) it compiles the modules below into
C extensions, and fails, saying why, where it cannot. Next to them it writes gateway/_compiled.json, the SHA-256
of each compiled source: `gateway/__init__.py` reads it at import and, where a source no longer matches what was
compiled (edited since the install), or with SLUICE_PURE=1 at run time, imports every one of these modules from
its source instead, warning loudly in the first case (docs/architecture.md, "The compiled hot path"). The
compiled build is opt-in (an install must work without a C compiler); the test suite builds it once per set of
sources outside the checkout and tests it beside the pure install (tests/support/compiled.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
MANIFEST = Path("gateway") / "_compiled.json"
GROUP = "gateway._compiled"  # the shared library of the group: gateway/_compiled__mypyc.*.so
# What each module gave and what it needed is in docs/architecture.md. Not compiled: gateway/server/protocol.py
# (its Cycle subclasses uvicorn's interpreted cycle, whose attributes mypyc's IR builder cannot see), the cache's
# Flight (an async generator, plugins/cache/flight.py) and the plugins' pydantic models (their config.py modules). A
# class compiled here cannot be subclassed by an interpreted one unless it says so (tests/unit/test_compiled_rules.py):
# the providers are compiled together for that reason.
MODULES = [
    "gateway/state/resp.py",
    "gateway/state/store.py",
    "gateway/wire/marks.py",
    "gateway/wire/completion.py",
    "gateway/upstream/pool.py",
    "gateway/upstream/connection.py",
    "gateway/upstream/attempts.py",
    "gateway/upstream/endpoints.py",
    "gateway/upstream/health.py",
    "gateway/upstream/providers/http.py",
    "gateway/upstream/providers/openai.py",
    "gateway/upstream/providers/azure.py",
    "gateway/upstream/providers/anthropic.py",
    "gateway/upstream/providers/selfhosted.py",
    "gateway/upstream/providers/vllm.py",
    "gateway/upstream/providers/llamacpp.py",
    "gateway/upstream/providers/tgi.py",
    "gateway/upstream/providers/ollama.py",
    "gateway/server/intake.py",
    "gateway/server/responder.py",
    "plugins/auth/authenticator.py",
    "plugins/auth/keys.py",
    "plugins/admission/controller.py",
    "plugins/admission/queue.py",
    "plugins/slo/policy.py",
    "gateway/server/relay.py",
    "gateway/server/request.py",
    "gateway/server/reply.py",
    "gateway/response.py",
    "gateway/telemetry/metrics.py",
    "gateway/telemetry/recorder.py",
    "gateway/telemetry/tracing.py",
    "gateway/telemetry/spans.py",
    "gateway/telemetry/access.py",
    "gateway/telemetry/console.py",
    "gateway/telemetry/durations.py",
    "gateway/context.py",
    "gateway/telemetry/series.py",
    "gateway/telemetry/tally.py",
    "gateway/telemetry/span_queue.py",
    "gateway/telemetry/tracecontext.py",
    "gateway/telemetry/quantiles.py",
    "plugins/rate_limit/limiter.py",
    "plugins/rate_limit/buckets.py",
    "plugins/rate_limit/concurrency.py",
    "plugins/rate_limit/lease.py",
    "plugins/rate_limit/sync.py",
    "plugins/cache/exact.py",
    "plugins/cache/flight.py",
    "plugins/cache/l1.py",
    "plugins/cache/layout.py",
    "plugins/cache/presence.py",
]
MODULES += ["gateway/pipeline.py", "gateway/server/direct.py", "gateway/server/reader.py"]  # the spine: one line


def compiler() -> str | None:
    """Why the modules are not compiled here, or None when they are; SystemExit where they were asked for and
    cannot be (a build asked to compile never quietly installs pure)."""
    if os.environ.get("SLUICE_COMPILE") != "1":
        return "the compiled build is opt-in: SLUICE_COMPILE=1"
    if os.environ.get("SLUICE_PURE") == "1":
        return "SLUICE_PURE=1"
    try:
        import mypyc.build  # noqa: F401
    except ImportError:
        raise SystemExit(
            "sluice: SLUICE_COMPILE=1 but mypyc is not importable in the build's environment: install mypy and "
            "build with --no-build-isolation"
        ) from None
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    if not cc or shutil.which(cc[0]) is None:
        raise SystemExit(f"sluice: SLUICE_COMPILE=1 but there is no C compiler ({' '.join(cc) or 'cc'})")
    return None


def artifacts(base: Path) -> list[Path]:
    """The built files of a previous compiled install under `base`: extensions (of the modules compiled then, or
    listed now), the group's library, the manifest. Left behind, an extension would be imported before its source."""
    sources = set(MODULES)
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
        sources |= set(json.loads((base / MANIFEST).read_text())["sources"])
    found = [base / MANIFEST, *base.glob("gateway/_compiled__mypyc*")]
    for source in sorted(sources):
        path = base / source
        found += path.parent.glob(path.stem + ".cpython-*") if path.exists() else []
        found += path.parent.glob(path.stem + ".*.pyd")
    return [path for path in found if path.exists()]


# mypy's settings for the build: the isolated build environment has mypy but not the gateway's dependencies, so
# their types are Any to the compiler (as they are, in effect, to compiled code: calls into them go through Python).
METADATA = {"egg_info", "dist_info"}  # the commands pip runs setup.py with for requirements and metadata
BUILDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}
BUILD_MYPY = """[mypy]
python_version = 3.11
ignore_missing_imports = True
follow_imports = silent
"""


class BuildExt(build_ext):
    """Compiles the modules (mypyc runs here rather than when setup.py is read: pip reads it several times) and
    writes the manifest of the sources they were compiled from."""

    def finalize_options(self) -> None:
        commands = set(sys.argv[1:])
        if commands & METADATA and not commands & BUILDS:  # pip asking for requirements or metadata: no build
            super().finalize_options()
            return
        for path in artifacts(ROOT):  # this build's own, or none: never a library of an earlier one
            path.unlink()
        why = compiler()
        if why is not None:
            print(f"sluice: installing pure Python ({why})")
            self.distribution.ext_modules = []
        else:
            from mypyc.build import mypycify

            with tempfile.TemporaryDirectory() as temp:
                config = Path(temp) / "mypyc.ini"
                config.write_text(BUILD_MYPY)
                made = mypycify(["--config-file", str(config), *MODULES], opt_level="3", group_name=GROUP)
            self.distribution.ext_modules = list(made)
        super().finalize_options()  # prepares the extensions it finds on the distribution

    def run(self) -> None:
        super().run()
        if not self.extensions:
            return
        base = ROOT if self.inplace else Path(self.build_lib)
        hashes = {source: hashlib.sha256((ROOT / source).read_bytes()).hexdigest() for source in MODULES}
        (base / MANIFEST).write_text(json.dumps({"group": GROUP, "sources": hashes}, indent=1) + "\n")


# A stand-in until build_ext runs: it makes the distribution one with extensions (a platform wheel) without running
# mypyc each time pip reads this file.
setup(ext_modules=[Extension(GROUP + "__mypyc", sources=[])], cmdclass={"build_ext": BuildExt})
