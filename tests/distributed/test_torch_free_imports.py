"""The planner's dry run and the schedule tooling run without torch: a fresh interpreter in which
any ``import torch`` fails imports them and plans."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCHEDULES = sorted(f"pipedream.schedules.{p.stem}" for p in (ROOT / "pipedream" / "schedules").glob("*.py")
                   if p.stem != "__init__")
TORCH_FREE = ["pipedream.schedules", *SCHEDULES, "pipedream.schedules.simulate", "pipedream.schedules.stream_model",
              "pipedream.schedules.async_segment", "pipedream.config.plan_file", "pipedream.devices", "models.plugin_config", "planner",
              "models.families.formulas", "models.facts", "models.families.vision_facts", "models.families.llama_facts",
              "models.families.moe_facts",
              "models.families.llama_hf", "planner.cluster.__main__",
              "planner.cluster.simulator", "pipedream.data.checks", "pipedream.data.corpora", "pipedream.data.prepare",
              "pipedream.checkpoint.integrity",
              "pipedream.observe.run_outputs", "launcher.prechecks", "pipedream.observe.trace_clock",
              "pipedream.config.multi_model", "pipedream.multi_model.feature_plan",
              "pipedream.multi_model.export"]
# A preset with a device sheet: ``local_cpu`` would measure this machine with torch.
DRY_RUN = ["model=gpt_tiny", "cluster=h100_x8", "cluster.nodes=1", "train.global_batch_size=16"]



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


# Imported by no small dry run: torch (the default cluster=local_cpu measures this machine with it),
# Hydra and OmegaConf (plain overrides compose to dicts), PyYAML (the configs' values are cached after
# the first run), the plotting and solver libraries.
NOT_AT_START_UP = ("torch", "hydra", "omegaconf", "antlr4", "yaml", "matplotlib", "scipy", "cvxpy", "transformers")


@pytest.mark.parametrize("args", [["planner.graph={graph}", "cluster=pipedream_cluster_a", "planner.algorithm=pipedream"],
                                  DRY_RUN], ids=["graph.txt", "preset"])
def test_a_small_dry_run_starts_only_what_it_uses(tmp_path, args):
    """``python -m planner``'s start-up: a graph.txt or a preset on a preset cluster imports none of
    ``NOT_AT_START_UP`` (numpy it needs: the schedules' closed forms, the DP and the cost model), and
    numpy's BLAS starts no threads (the process has one) nor leaves its setting to child processes."""
    from tests.support.graph_txt_profiles import vgg16_graph

    graph = tmp_path / "vgg16" / "graph.txt"
    graph.parent.mkdir()
    graph.write_text(vgg16_graph())
    args = [a.format(graph=graph) for a in args]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "OPENBLAS_NUM_THREADS")}
    warm = f"from pipedream.config.loading import compose_plain_dicts; compose_plain_dicts({args!r}, 'planner')"
    subprocess.run([sys.executable, "-c", warm], cwd=ROOT, env=env, check=True, timeout=60)   # caches the values
    script = "\n".join([
        "import contextlib, io, os, runpy, sys",
        f"sys.argv = ['planner', *{args!r}]",
        "with contextlib.redirect_stdout(io.StringIO()):",
        "    try:",
        "        runpy.run_module('planner', run_name='__main__')",
        "    except SystemExit as done:",
        "        assert not done.code, done.code",
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(NOT_AT_START_UP)!r}))",
        "print(len(os.listdir('/proc/self/task')), 'OPENBLAS_NUM_THREADS' in os.environ)",
    ])
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["[]", "1 False"]
