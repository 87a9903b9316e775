"""The house rule: imports between the gateway's rooms point one way, and the core never imports a plugin or a tool.

The rooms, from the top down (docs/architecture.md, "Layout"): a module may import its own room and any room
below it. Imports made only for annotations (under `if TYPE_CHECKING:`) are not edges: they run nothing.
Plugins may use the core but never another plugin; the core imports a tool only in `gateway.cli`, inside the
function of the command that runs it, so that serving never loads one.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Rank of each room: higher may import lower. The spine's contract (settings, context, plugin, errors) sits
# below every room that uses it; `state` and `wire` (the wire forms) import nothing above them.
RANKS = {
    "top": 10,  # app, cli, runtime, config, pipeline
    "responses": 9,
    "messages": 9,  # Anthropic's Messages API: a front door beside the Responses API, using the rooms below
    "jobs": 8,  # background jobs: the Responses API starts and reads them, they know nothing of it
    "server": 7,
    "upstream": 6,
    "simulation": 5,
    "telemetry": 4,
    "contract": 3,  # gateway/__init__, settings, context, plugin, response, errors, handoff
    "wire": 2,
    "state": 1,
}
TOP = {"app", "cli", "runtime", "config", "pipeline"}
CONTRACT = {"settings", "context", "plugin", "response", "errors", "handoff"}


@dataclass(frozen=True)
class Edge:
    source: str  # dotted module name
    target: str
    in_function: bool
    line: int


def room(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "gateway":
        return parts[0] if parts[0] != "plugins" or len(parts) == 1 else f"plugins.{parts[1]}"
    if len(parts) == 1 or parts[1] in CONTRACT:
        return "contract"
    if parts[1] in TOP:
        return "top"
    return parts[1]


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


class Imports(ast.NodeVisitor):
    """One module's imports, each with whether it runs inside a function; `if TYPE_CHECKING:` blocks skipped."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.depth = 0
        self.found: list[Edge] = []

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" not in ast.unparse(node.test):
            self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        self.add([alias.name for alias in node.names], node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:
            targets = []
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                is_module = (ROOT / Path(*full.split("."))).with_suffix(".py").exists()
                targets.append(full if is_module else node.module)
            self.add(targets, node.lineno)

    def add(self, targets: list[str], line: int) -> None:
        for target in targets:
            if target.split(".")[0] in ("gateway", "plugins", "tools"):
                self.found.append(Edge(self.source, target, self.depth > 0, line))


@functools.cache
def edges() -> tuple[Edge, ...]:
    found: list[Edge] = []
    for top in ("gateway", "plugins", "tools"):
        for path in sorted((ROOT / top).rglob("*.py")):
            imports = Imports(module_name(path))
            imports.visit(ast.parse(path.read_text(), str(path)))
            found += imports.found
    return tuple(found)


def test_the_graph_is_read_at_all() -> None:
    # A reader that saw nothing would pass every rule below.
    found = edges()
    assert len(found) > 200
    assert any(e.source == "gateway.pipeline" and e.target == "gateway.upstream.attempts" for e in found)
    assert room("gateway.upstream.providers.http") == "upstream"
    assert room("gateway.errors") == "contract"
    assert room("plugins.cache.commands") == "plugins.cache"


def test_rooms_of_the_gateway_import_only_downward() -> None:
    wrong = [
        f"{e.source}:{e.line} ({room(e.source)}) imports {e.target} ({room(e.target)})"
        for e in edges()
        if e.source.startswith("gateway")
        and e.target.startswith("gateway")
        and room(e.source) != room(e.target)
        and RANKS[room(e.source)] < RANKS[room(e.target)]
    ]
    assert wrong == []


def test_every_room_is_ranked() -> None:
    rooms = {room(module_name(p)) for p in (ROOT / "gateway").rglob("*.py")}
    assert rooms == set(RANKS)
    for folder in (ROOT / "gateway").iterdir():
        if folder.is_dir() and (folder / "__init__.py").exists():
            doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
            assert doc, f"{folder.name}/__init__.py says what the room owns and what it may import"


def test_the_core_imports_no_plugin_and_a_tool_only_when_its_command_runs() -> None:
    wrong = []
    for e in edges():
        if not e.source.startswith("gateway"):
            continue
        if e.target.startswith("plugins"):
            wrong.append(f"{e.source}:{e.line} imports the plugin {e.target}")
        if e.target.startswith("tools") and not (e.source == "gateway.cli" and e.in_function):
            wrong.append(f"{e.source}:{e.line} imports the tool {e.target} at import time")
    assert wrong == []


def test_no_plugin_imports_another_or_a_tool() -> None:
    wrong = [
        f"{e.source}:{e.line} imports {e.target}"
        for e in edges()
        if e.source.startswith("plugins.")
        and (e.target.startswith("tools") or (e.target.startswith("plugins.") and room(e.target) != room(e.source)))
    ]
    assert wrong == []


def test_every_folder_of_code_is_a_package_that_says_what_it_owns() -> None:
    """A folder of modules without `__init__.py` is left out of an installed wheel (setuptools finds packages by
    it) and out of the import checks above; its docstring is the room's charter."""
    for top in ("gateway", "plugins", "tools"):
        for folder in [ROOT / top, *(p for p in (ROOT / top).rglob("*") if p.is_dir())]:
            if folder.name == "__pycache__" or not any(folder.glob("*.py")):
                continue
            init = folder / "__init__.py"
            assert init.is_file(), f"{folder.relative_to(ROOT)} has modules but no __init__.py"
            assert ast.get_docstring(ast.parse(init.read_text())), f"{init.relative_to(ROOT)} has no docstring"


def test_each_rooms_charter_names_the_rooms_it_imports_and_no_other() -> None:
    """The last line of a room's charter, `Imports: a, b.`, is what its modules import from other rooms at run
    time: a charter that names a room its code does not import, or leaves out one it does, is wrong."""
    actual: dict[str, set[str]] = {}
    for e in edges():
        if e.source.startswith("gateway") and e.target.startswith("gateway") and room(e.source) != room(e.target):
            actual.setdefault(room(e.source), set()).add(room(e.target))
    wrong = []
    for init in sorted((ROOT / "gateway").glob("*/__init__.py")):
        name = init.parent.name
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        lines = [line for line in doc.splitlines() if line.startswith("Imports: ")]
        if len(lines) != 1:
            wrong.append(f"{name}: its charter has no line `Imports: ...`")
            continue
        named = {part.strip() for part in lines[0].removeprefix("Imports: ").rstrip(".").split(",")} - {"none"}
        if named != actual.get(name, set()):
            wrong.append(
                f"{name}: the charter names {sorted(named)}, the code imports {sorted(actual.get(name, set()))}"
            )
    assert wrong == []
