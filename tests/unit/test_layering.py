"""Import layering: the planner's dry run and the schedule tooling run without torch, the runtime
never imports the planner (the planner may import the runtime's schedules and simulator), and the
models never import the runtime's data pipeline."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCHEDULES = sorted(f"pipedream.schedules.{p.stem}" for p in (ROOT / "pipedream" / "schedules").glob("*.py")
                   if p.stem != "__init__")
TORCH_FREE = ["pipedream.schedules", *SCHEDULES, "pipedream.simulate", "pipedream.stream_model",
              "pipedream.async_segment", "pipedream.plan_file", "pipedream.devices", "planner",
              "models.formulas", "models.facts"]
# A preset with a device sheet: ``local_cpu`` would measure this machine with torch.
DRY_RUN = ["model=gpt_tiny", "cluster=h100_x8", "cluster.nodes=1", "train.global_batch_size=16"]


def imported_modules(path: Path) -> set[str]:
    """Absolute module names ``path`` imports, anywhere in the file (lazy imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_torch_free_modules_and_the_planner_dry_run_import_no_torch():
    script = "\n".join([
        "import contextlib, io, sys",
        "sys.modules['torch'] = None  # any 'import torch' now raises ImportError",
        *(f"import {name}" for name in TORCH_FREE),
        "from planner.__main__ import main",
        "with contextlib.redirect_stdout(io.StringIO()):",
        f"    sys.exit(main({DRY_RUN!r}))",
    ])
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_runtime_never_imports_the_planner():
    offenders = [f"{path.relative_to(ROOT)} imports {name}"
                 for path in sorted((ROOT / "pipedream").rglob("*.py"))
                 for name in imported_modules(path) if name == "planner" or name.startswith("planner.")]
    assert not offenders, offenders


def test_models_do_not_import_the_data_pipeline():
    offenders = [f"{path.relative_to(ROOT)} imports {name}"
                 for path in sorted((ROOT / "models").glob("*.py"))
                 for name in imported_modules(path) if name.startswith("pipedream.data")]
    assert not offenders, offenders
