"""What mypyc needs of the modules setup.py compiles, checked on their sources (the compiled build's tests would
find a breach only on the path that runs it).

An interpreted class cannot subclass a compiled one (its instances fail to be made: "interpreted classes cannot
inherit from compiled") unless the compiled class allows it (`mypyc_attr(allow_interpreted_subclasses=True)`);
exception classes are compiled as ordinary classes and may be subclassed.

A name bound by two `except` clauses of one function gets one type in compiled code, the first clause's: an
exception of the other clause's class then fails that type's check inside the handler (a TypeError where the
error should have been answered), as it did for a first-token deadline in `Upstreams.open`.
"""

from __future__ import annotations

import ast
import importlib
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


def test_no_interpreted_class_subclasses_a_compiled_one_that_does_not_allow_it() -> None:
    compiled = set(modules())
    defined: dict[str, tuple[str, ast.ClassDef]] = {}
    for module in compiled:
        for statement in ast.parse((ROOT / module).read_text(), module).body:
            if isinstance(statement, ast.ClassDef):
                defined[statement.name] = (module, statement)
    found = []
    for path in sorted({*ROOT.glob("gateway/**/*.py"), *ROOT.glob("plugins/**/*.py"), *ROOT.glob("tools/**/*.py")}):
        source = str(path.relative_to(ROOT))
        if source in compiled:
            continue
        for node in ast.walk(ast.parse(path.read_text(), source)):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                name = ast.unparse(base).split("[")[0].rsplit(".", 1)[-1]
                if name not in defined:
                    continue
                module, parent = defined[name]
                cls = getattr(importlib.import_module(module[:-3].replace("/", ".")), name)
                allowed = any("allow_interpreted_subclasses=True" in ast.unparse(d) for d in parent.decorator_list)
                if not allowed and not issubclass(cls, BaseException):
                    found.append(f"{source}: {node.name} subclasses {module}'s {name}")
    assert not found, "\n".join(found)
