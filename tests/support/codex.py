"""The OpenAI Codex CLI from npm, installed once into a cache directory (its native binary ships in the package).

Skips, saying why, where node or npm is missing (`.ci/run` installs them with apt) or the install fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

VERSION = "0.169.0"
CACHE = Path(os.environ.get("SLUICE_CACHE", Path.home() / ".cache" / "sluice")) / f"npm-codex-{VERSION}"
INSTALL_TIMEOUT_S = 600


def codex_or_skip() -> Path:
    """The path of the `codex` executable of @openai/codex at VERSION."""
    binary = CACHE / "node_modules" / ".bin" / "codex"
    if binary.exists():
        return binary
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (apt-get install nodejs npm): the Codex CLI tests need it")
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / "package.json").write_text('{"name": "sluice-codex-cli", "private": true}\n')
    try:
        subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--loglevel=error", f"@openai/codex@{VERSION}"],
            cwd=CACHE,
            check=True,
            capture_output=True,
            timeout=INSTALL_TIMEOUT_S,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        output = getattr(exc, "stderr", b"") or b""
        pytest.skip(f"npm could not install @openai/codex@{VERSION}: {output.decode(errors='replace')[-500:]}")
    if not binary.exists():
        pytest.skip(f"npm installed @openai/codex@{VERSION} without its executable at {binary}")
    return binary


def codex_home(directory: Path, base_url: str, model: str) -> Path:
    """A CODEX_HOME whose built-in OpenAI provider talks to `base_url` (WebSocket first, as against OpenAI)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.toml").write_text(f'model = "{model}"\nopenai_base_url = "{base_url}"\n')
    return directory
