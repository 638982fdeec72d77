"""Outside ``pipedream/schedules/`` no code compares a schedule's name with a string literal or tests
it against a collection of names: it reads the schedule's ``ScheduleInfo`` instead (registry.py).
The runtime's docstrings and comments describe those flags, not lists of the schedules that set them."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

from pipedream.schedules import SCHEDULE_INFOS

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("pipedream", "planner", "launcher", "models")
OWNER = ROOT / "pipedream" / "schedules"


def names_schedules(node: ast.AST) -> bool:
    """A schedule-name literal, a literal collection holding one, or a ``*_SCHEDULES`` constant."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in SCHEDULE_INFOS
    if isinstance(node, (ast.Set, ast.Tuple, ast.List)):
        return any(names_schedules(element) for element in node.elts)
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name.endswith("SCHEDULES")


def name_comparisons(source: str) -> list[int]:
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Compare) and any(names_schedules(side) for side in (node.left, *node.comparators))]


def test_the_scanner_finds_each_form() -> None:
    assert name_comparisons("x = spec.schedule == 'interleaved'") == [1]
    assert name_comparisons("if name in ('2bw', 'pipedream'): pass") == [1]
    assert name_comparisons("ok = s not in ASYNC_SCHEDULES") == [1]
    assert name_comparisons("ok = s not in zero_bubble.SCHEDULES") == [1]
    assert name_comparisons("ok = info.asynchronous and kind == 'vshape'") == []


def test_no_schedule_name_is_compared_outside_the_schedules_package() -> None:
    found = []
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            if OWNER in path.parents:
                continue
            found += [f"{path.relative_to(ROOT)}:{line}" for line in name_comparisons(path.read_text())]
    assert not found, f"read the schedule's ScheduleInfo instead of comparing names: {', '.join(found)}"


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every docstring and comment in ``source``."""
    texts = [(getattr(node, "lineno", 1), ast.get_docstring(node, clean=False) or "")
             for node in ast.walk(ast.parse(source))
             if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    texts += [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
              if token.type == tokenize.COMMENT]
    return texts


def named_schedules(text: str) -> list[str]:
    """Schedule names standing as words (``pipedream.x`` and ``pipedream/x`` are the package)."""
    words = "|".join(re.escape(name) for name in SCHEDULE_INFOS)
    return re.findall(rf"(?<![\w./-])({words})(?![\w/-]|\.\w)", text)


def test_the_prose_scanner_finds_names_not_the_package() -> None:
    assert named_schedules("FlushRunner (1f1b, gpipe, interleaved)") == ["1f1b", "gpipe", "interleaved"]
    assert named_schedules("see pipedream/runtime and ``pipedream.schedules``") == []
    assert prose("x = 1   # zbv only\n") == [(1, ""), (1, "# zbv only")]


def test_runtime_prose_names_flags_not_schedules() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}: {', '.join(names)}"
             for path in sorted((ROOT / "pipedream" / "runtime").rglob("*.py"))
             for line, text in prose(path.read_text()) if (names := named_schedules(text))]
    assert not found, f"describe the ScheduleInfo flag instead of naming schedules: {'; '.join(found)}"
