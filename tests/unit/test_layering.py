"""Import layering: the runtime never imports the planner (the planner may import the runtime's
schedules and simulator), and the models never import the runtime's data pipeline. (That the
planner's dry run needs no torch is checked in a fresh interpreter: tests/distributed.)"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> set[str]:
    """Absolute module names ``path`` imports, anywhere in the file (lazy imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_runtime_never_imports_the_planner():
    offenders = [f"{path.relative_to(ROOT)} imports {name}"
                 for path in sorted((ROOT / "pipedream").rglob("*.py"))
                 for name in imported_modules(path) if name == "planner" or name.startswith("planner.")]
    assert not offenders, offenders


def test_models_do_not_import_the_data_pipeline():
    offenders = [f"{path.relative_to(ROOT)} imports {name}"
                 for path in sorted((ROOT / "models").glob("*.py"))
                 for name in imported_modules(path) if name.startswith("pipedream.data.datasets")]
    assert not offenders, offenders
