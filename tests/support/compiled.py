"""The compiled request path (setup.py's mypyc build) for the tests, whichever build the suite itself runs.

The suite runs the install it finds, pure by default. So that the compiled build is tested too, its extensions
are built once per set of sources, outside the checkout, and cached: under ~/.cache/sluice/compiled/<key>, where
the key is the SHA-256 of setup.py, of each module it compiles, and of the interpreter's and mypy's versions. The
build runs `setup.py build_ext --inplace` with SLUICE_COMPILE=1 in a scratch copy of the gateway's and plugins'
sources (4 to 6 minutes on 2 busy cores; under a file lock, so that concurrent sessions build once) and keeps only
what it made: the extensions and `gateway/_compiled.json`. A test then gets a copy of the checkout (its sources,
not its build) with those dropped in place: a process started there with `python -m` imports `gateway` from it,
compiled. Where the build cannot be made (no C compiler, no Python headers, no mypyc) those tests skip, saying
why; with $SLUICE_SKIP_COMPILED set they skip; a build that fails where it can run fails them.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tools.lock import locked

ROOT = Path(__file__).resolve().parents[2]
SKIP = "SLUICE_SKIP_COMPILED"
MANIFEST = Path("gateway") / "_compiled.json"
SOURCES = ("gateway", "plugins")  # what mypyc reads: the compiled modules and everything they import of ours
# Not copied into a test's tree: the checkout's own build, caches, and what the tests do not read.
LEFT_OUT = {
    ".git",
    ".venv",
    "build",
    "dist",
    "__pycache__",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    "node_modules",
}
BUILD_TIMEOUT_S = 3600.0  # the compile takes 4 to 6 minutes on 2 cores; far longer means something hangs


class Unavailable(RuntimeError):
    """The compiled build cannot be made here: the message says why, for a test's skip reason."""


@dataclass(frozen=True, slots=True)
class Build:
    where: Path  # the cached extensions and manifest, at their paths relative to the tree
    seconds: float  # how long the build took; 0.0 when it came from the cache


def modules() -> list[str]:
    """The sources setup.py compiles (its MODULES, literal lists), read without running it."""
    found: list[str] = []
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "MODULES" for t in targets):
                found += ast.literal_eval(node.value)
    return found


def key() -> str:
    """What the extensions depend on: setup.py, the compiled sources, the interpreter and mypyc."""
    digest = hashlib.sha256()
    for part in (sys.version, sys.platform, importlib.metadata.version("mypy")):
        digest.update(part.encode() + b"\0")
    for source in ["setup.py", *modules()]:
        digest.update(source.encode() + b"\0" + (ROOT / source).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    configured = os.environ.get("SLUICE_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "sluice"


def home() -> Path:
    return cache_root() / "compiled" / key()


def missing() -> str | None:
    """Why the compiled build cannot be made here (a test's skip reason), or None when it can."""
    if os.environ.get(SKIP):
        return f"${SKIP} is set"
    for needed in ("mypyc", "setuptools"):
        if importlib.util.find_spec(needed) is None:
            return f"the compiled build needs {needed} in this environment (pip install -e '.[test]' brings both)"
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    if not cc or shutil.which(cc[0]) is None:
        return f"there is no C compiler ({' '.join(cc) or 'cc'}) to build the compiled request path"
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.is_file():
        return f"the interpreter's C headers are not installed ({headers}; Debian: python3-dev)"
    return None


def cached() -> Build | None:
    where = home()
    return Build(where, 0.0) if (where / MANIFEST).is_file() else None


def announcement() -> str | None:
    """One line for the start of a run that will compile the request path, else None."""
    why = missing()
    if why is not None:
        return f"compiled request path: its tests skip ({why})"
    if cached() is not None:
        return None
    return (
        "compiled request path: not built for these sources yet: the first test that needs it compiles it with"
        f" mypyc (4 to 6 min on 2 cores; cached in {home()}); set {SKIP}=1 to skip those tests instead"
    )


def ensure() -> Build:
    """The cached build, else build it now (under a lock, so that concurrent sessions build once)."""
    found = cached()
    if found is not None:
        return found
    why = missing()
    if why is not None:
        raise Unavailable(why)
    where = home()
    where.parent.mkdir(parents=True, exist_ok=True)
    with locked(where.parent / f"{where.name}.lock"):
        found = cached()  # built by whoever held the lock before us
        return found if found is not None else _build(where)


def _build(where: Path) -> Build:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="compiled-", dir=where.parent) as scratch:
        tree = Path(scratch) / "tree"
        for name in ("setup.py", "pyproject.toml", "README.md"):
            _copy(ROOT / name, tree / name)
        for name in SOURCES:
            shutil.copytree(ROOT / name, tree / name, ignore=_left_out)
        env = {k: v for k, v in os.environ.items() if k != "SLUICE_PURE"}
        env["SLUICE_COMPILE"] = "1"
        log = Path(scratch) / "build.log"
        with log.open("w") as out:
            done = subprocess.run(
                [sys.executable, "setup.py", "build_ext", "--inplace"],
                cwd=tree,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=BUILD_TIMEOUT_S,
                check=False,
            )
        if done.returncode != 0 or not (tree / MANIFEST).is_file():
            tail = log.read_text(errors="replace").strip().splitlines()[-15:]
            raise RuntimeError(f"the compiled build failed ({done.returncode}):\n" + "\n".join(tail))
        partial = Path(scratch) / "made"
        for path in _artifacts(tree):
            _copy(path, partial / path.relative_to(tree))
        seconds = time.monotonic() - started
        (partial / "build.json").write_text(json.dumps({"seconds": round(seconds, 1)}) + "\n")
        partial.rename(where)  # whole or not at all: the manifest is what `cached` looks for
    return Build(where, seconds)


def _artifacts(tree: Path) -> list[Path]:
    found = [tree / MANIFEST, *tree.glob("gateway/_compiled__mypyc*")]
    for source in modules():
        path = tree / source
        found += path.parent.glob(path.stem + ".cpython-*")
    return found


def _copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, target)


def _left_out(directory: str, names: list[str]) -> set[str]:
    built = (".so", ".pyd", ".egg-info")
    return {n for n in names if n in LEFT_OUT or n.endswith(built) or n == MANIFEST.name}


def tree(build: Build, into: Path) -> Path:
    """A copy of the checkout's sources, tests and tools under `into`, with the compiled extensions in place."""
    shutil.copytree(ROOT, into, ignore=_left_out)
    for path in build.where.rglob("*"):
        if path.is_file() and path.name != "build.json":
            _copy(path, into / path.relative_to(build.where))
    return into
