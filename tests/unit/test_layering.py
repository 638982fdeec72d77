"""Import layering, read from the source (lazy imports inside functions included):

* no import cycle between any two modules of the project;
* no import cycle between the subpackages of ``pipedream/`` or of ``planner/`` (a module at the top of
  either, such as ``pipedream/trainer.py``, counts as a unit of its own): each subpackage sits on a
  floor and imports only from floors below it (docs/design.md, Layering);
* ``models/`` (the bottom layer) imports nothing from ``pipedream/``, and ``pipedream/`` (the
  runtime) nothing from ``planner/``;
* the top of ``pipedream/`` and ``planner/`` stays small: everything else lives in a subpackage.

(That the planner's dry run needs no torch is checked in a fresh interpreter: tests/distributed.)"""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pipedream", "planner", "models", "launcher", "conf", "scripts", "tests")
MAX_TOP_LEVEL_FILES = {"pipedream": 12, "planner": 10}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports: ``from a.b import c`` names ``a.b.c`` where that is a
    module, else ``a.b``; relative imports are resolved against the importing module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            candidates = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:   # `import a.b.c` of a name inside a module
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                found.add(candidate)
    return found


@cache   # every test reads the same tree: parse it once
def import_graph() -> dict[str, frozenset[str]]:
    modules = project_modules()
    known = set(modules)
    return {name: frozenset(imports_of(name, path, known)) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def unit_of(module: str) -> str:
    """``pipedream.runtime.engine`` -> ``pipedream.runtime``; a top-level module is its own unit."""
    return ".".join(module.split(".")[:2])


def unit_graph(package: str) -> dict[str, set[str]]:
    """The import graph of ``package``'s units, each edge kept with the module imports behind it."""
    graph: dict[str, set[str]] = {}
    for name, targets in import_graph().items():
        if name.split(".")[0] != package:
            continue
        for target in targets:
            if target.split(".")[0] == package and unit_of(target) != unit_of(name):
                graph.setdefault(unit_of(name), set()).add(unit_of(target))
    return graph


def test_the_cycle_finder_finds_a_lazy_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_relative_and_lazy_imports_are_read(tmp_path):
    source = "from .sibling import x\n\ndef f():\n    from pkg.other import y\n"
    path = tmp_path / "mod.py"
    path.write_text(source)
    assert imports_of("pkg.mod", path, {"pkg.mod", "pkg.sibling", "pkg.other"}) == {"pkg.sibling", "pkg.other"}


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph()) == []


def test_no_subpackage_imports_itself_through_others():
    for package in ("pipedream", "planner"):
        found = cycles(unit_graph(package))
        behind = {unit: sorted(f"{name} imports {target}" for name, targets in import_graph().items()
                               if unit_of(name) in unit for target in targets
                               if unit_of(target) in unit and unit_of(target) != unit_of(name))
                  for unit in map(frozenset, found)}
        assert not found, f"{package}: subpackages import each other in a loop: {list(behind.values())}"


def test_models_import_nothing_from_the_runtime():
    offenders = [f"{name} imports {target}" for name, targets in import_graph().items() if name.startswith("models")
                 for target in targets if target.split(".")[0] == "pipedream"]
    assert not offenders, offenders


def test_the_runtime_never_imports_the_planner():
    offenders = [f"{name} imports {target}" for name, targets in import_graph().items() if name.startswith("pipedream")
                 for target in targets if target.split(".")[0] == "planner"]
    assert not offenders, offenders


def test_the_top_of_each_package_stays_small():
    for package, limit in MAX_TOP_LEVEL_FILES.items():
        files = sorted(path.name for path in (ROOT / package).glob("*.py"))
        assert len(files) <= limit, f"{package}/ has {len(files)} modules at its top (limit {limit}): {files}"
