"""The example user project (examples/masked_sequences): its README's three commands (profile,
plan, train with two pipeline stages) run as written, with the package on PYTHONPATH; plain
torchrun trains it too; a plugin that cannot be imported stops the launcher with one line."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "masked_sequences"
FAST = ["train.progress=false", "train.log_every=10", "train.timeout_s=60"]


def readme_commands() -> list[list[str]]:
    text = (EXAMPLE / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line) for line in block.splitlines() if line.startswith("python -m ")]


def run(command: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(EXAMPLE), "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def python(command: list[str]) -> list[str]:
    assert command[0] == "python"
    return [sys.executable, *command[1:]]


@pytest.mark.slow
def test_readme_profile_plan_train(tmp_path):
    profile, plan, train = readme_commands()
    assert [c[2] for c in (profile, plan, train)] == ["planner.profile", "planner", "launcher"]
    for command in (profile, plan):
        done = run(python(command), tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
    measured = json.loads((tmp_path / "profile.json").read_text())
    assert measured["source"] == "measured" and len(measured["layers"]) == 4
    # the embedding sends hidden states (float32) and the mask (bool): width * 4 + 1 bytes per position
    assert measured["layers"][0]["output_bytes"] == 16 * (32 * 4 + 1)
    planned = json.loads((tmp_path / "plan.json").read_text())
    assert planned["parallel"]["pp"] == 2
    done = run(python(train) + FAST, tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(next((tmp_path / "runs").glob("*/summary.json")).read_text())
    assert summary["parallel"]["pp"] == 2 and summary["schedule"] == planned["schedule"]
    first_loss = json.loads(next((tmp_path / "runs").glob("*/metrics.jsonl")).read_text().splitlines()[0])["loss"]
    assert summary["final_train_loss"] < 0.8 * first_loss   # it learns
    assert all(rank["bytes_sent"] > 0 for rank in summary["ranks"])


@pytest.mark.slow
def test_plain_torchrun_trains_the_plugin(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                "-m", "pipedream.train", "model._target_=maskseq.model.build", "model.width=16",
                "data._target_=maskseq.data.build", "parallel.pp=2", "train.steps=4", "train.eval_every=0",
                f"train.run_dir={tmp_path / 'run'}", *FAST]
    done = run(torchrun, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["parallel"]["pp"] == 2


@pytest.mark.slow
def test_an_unimportable_plugin_stops_the_launcher_with_one_line(tmp_path):
    done = run([sys.executable, "-m", "launcher", "model._target_=maskseq.model.no_such_build",
                "data._target_=maskseq.data.build"], tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith("error: model._target_=maskseq.model.no_such_build cannot be imported")
    assert not (tmp_path / "runs").exists()
