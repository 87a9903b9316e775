"""Sluice: a latency-first, OpenAI-compatible LLM gateway.

Where the install compiled the request path's modules (setup.py: mypyc, when a C compiler is there), this
package holds `_compiled.json`, the SHA-256 of each source as it was compiled. Their sources stay the truth: with
SLUICE_PURE=1, or when a source no longer matches (edited since the install, which would otherwise leave the old
extension running silently), every one of them is imported from its `.py` instead, the latter with a warning.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__version__ = "0.1.0"

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = Path(__file__).resolve().parent / "_compiled.json"


class Sources(importlib.abc.MetaPathFinder):
    """Finds the compiled modules' `.py` sources ahead of their extensions."""

    def __init__(self, modules: dict[str, Path]) -> None:
        self.modules = modules

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        source = self.modules.get(fullname)
        if source is None:
            return None
        loader = importlib.machinery.SourceFileLoader(fullname, str(source))
        package = source.name == "__init__.py"
        spec = importlib.machinery.ModuleSpec(fullname, loader, origin=str(source), is_package=package)
        if package:
            spec.submodule_search_locations = [str(source.parent)]
        spec.has_location = True
        return spec


def compiled_sources() -> dict[str, str]:
    """The compiled modules' sources (relative paths) and their hashes as compiled; empty for a pure install."""
    try:
        data = json.loads(MANIFEST.read_text())
    except FileNotFoundError:
        return {}
    return {str(source): str(digest) for source, digest in data["sources"].items()}


def module_of(source: str) -> str:
    return ".".join(Path(source).with_suffix("").parts).removesuffix(".__init__")


def use_sources() -> str | None:
    """Why the compiled modules are bypassed (imported from source), or None when they are used or absent."""
    compiled = compiled_sources()
    if not compiled:
        return None
    if os.environ.get("SLUICE_PURE") == "1":
        why = "SLUICE_PURE=1"
    else:
        stale = [s for s, digest in compiled.items() if hashlib.sha256((ROOT / s).read_bytes()).hexdigest() != digest]
        if not stale:
            return None
        why = f"edited since they were compiled: {', '.join(stale)}"
        warnings.warn(
            f"sluice: compiled modules {why}; running every compiled module from its source. Rebuild with"
            " `SLUICE_COMPILE=1 python3 -m pip install --no-build-isolation -e .` (or set SLUICE_PURE=1 to run pure"
            " Python on purpose)",
            RuntimeWarning,
            stacklevel=2,
        )
    # All of them or none: compiled modules call one another natively, past an interpreted replacement.
    sys.meta_path.insert(0, Sources({module_of(s): ROOT / s for s in compiled}))
    return why


BYPASSED = use_sources()


def compiled() -> bool:
    """Whether the request path's compiled modules are what this process runs."""
    return bool(compiled_sources()) and BYPASSED is None
