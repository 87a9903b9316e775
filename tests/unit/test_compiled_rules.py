"""What mypyc needs of the modules setup.py compiles, checked on their sources (the compiled build's tests would
find a breach only on the path that runs it).

A name bound by two `except` clauses of one function gets one type in compiled code, the first clause's: an
exception of the other clause's class then fails that type's check inside the handler (a TypeError where the
error should have been answered), as it did for a first-token deadline in `Upstreams.open`.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.compiled import modules

ROOT = Path(__file__).resolve().parents[2]


def test_no_compiled_function_binds_one_exception_name_to_two_types() -> None:
    found = []
    for module in modules():
        tree = ast.parse((ROOT / module).read_text(), module)
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            types: dict[str, set[str]] = {}
            for node in ast.walk(function):
                if isinstance(node, ast.ExceptHandler) and node.name:
                    caught = ast.unparse(node.type) if node.type is not None else "BaseException"
                    types.setdefault(node.name, set()).add(caught)
            found += [
                f"{module}:{function.lineno} {function.name}: {name} as {sorted(kinds)}"
                for name, kinds in types.items()
                if len(kinds) > 1
            ]
    assert not found, "\n".join(found)
