"""Claude Code (`@anthropic-ai/claude-code` from npm), installed once into ~/.cache/sluice and run offline.

Its native binary is an npm optional dependency, so nothing downloads when it runs. A machine without node
or npm skips the tests that need it, saying how to get them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

VERSION = "2.1.328"
PACKAGE = f"@anthropic-ai/claude-code@{VERSION}"
CACHE = Path.home() / ".cache" / "sluice" / f"npm-claude-code-{VERSION}"
INSTALL_TIMEOUT_S = 600


def install_or_skip() -> Path:
    """The `claude` executable of the pinned version: installed into the cache on first use."""
    binary = CACHE / "node_modules" / ".bin" / "claude"
    if binary.exists():
        return binary
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        pytest.skip("node and npm are not installed (apt-get install nodejs npm): Claude Code comes from npm")
    CACHE.mkdir(parents=True, exist_ok=True)
    if not (CACHE / "package.json").exists():
        (CACHE / "package.json").write_text('{"name": "sluice-test-clients", "private": true}\n')
    done = subprocess.run(
        [npm, "install", "--no-audit", "--no-fund", "--prefix", str(CACHE), PACKAGE],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0 or not binary.exists():
        pytest.fail(f"npm install {PACKAGE} failed ({done.returncode}): {done.stderr[-2000:]}")
    return binary


def run(
    binary: Path, base_url: str, home: Path, prompt: str, model: str, key: str = "unused", timeout: float = 180.0
) -> subprocess.CompletedProcess[str]:
    """`claude -p PROMPT --model MODEL` against `base_url` with `key` (sent as x-api-key) and a throw-away home."""
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": key,
        "DISABLE_AUTOUPDATER": "1",
    }
    return subprocess.run(
        [str(binary), "-p", prompt, "--model", model],
        cwd=home,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
