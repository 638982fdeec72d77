"""How tests/ and scripts/ are laid out (docs/design.md, Tests and scripts): every folder of Python
files is a package, so modules are imported by their dotted names (same-named test files cannot
collide) and nothing needs sys.path edits; scripts/ is importable but not shipped by pip."""
from __future__ import annotations

import ast
import importlib
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "tests" / "support" / "process_probe"   # a PYTHONPATH folder (sitecustomize), not a package


def python_folders(top: Path) -> set[Path]:
    return {path.parent for path in top.rglob("*.py") if PROBE not in (path.parent, *path.parent.parents)}


@pytest.mark.parametrize("top", ["tests", "scripts"])
def test_every_folder_of_python_files_is_a_package(top):
    missing = sorted(str(folder.relative_to(ROOT)) for folder in python_folders(ROOT / top)
                     if not (folder / "__init__.py").exists())
    assert not missing, f"add an __init__.py to: {missing}"


def _edits_sys_path(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("insert", "append", "extend"):
            target = node.func.value
            if isinstance(target, ast.Attribute) and target.attr == "path" and \
                    isinstance(target.value, ast.Name) and target.value.id == "sys":
                return True
    return False


def test_no_module_edits_sys_path():
    files = [path for top in ("tests", "scripts") for path in (ROOT / top).rglob("*.py")]
    offenders = sorted(str(path.relative_to(ROOT)) for path in files
                       if _edits_sys_path(ast.parse(path.read_text(encoding="utf-8"))))
    assert not offenders


def test_every_script_module_imports_as_a_package_module():
    for path in sorted((ROOT / "scripts").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        importlib.import_module(name)


def test_pip_ships_neither_scripts_nor_tests():
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not any(pattern.startswith(("scripts", "tests")) for pattern in include)
