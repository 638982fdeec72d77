"""``checkpoint.at_end`` (default true): a run that has done its steps keeps its trained weights, so
the README's train-then-export works without any checkpoint key; ``false`` keeps none."""
from __future__ import annotations

import json

import pytest

from pipedream.checkpoint.store import complete_checkpoints
from tests.support.checkpoint_harness import train_full
from tests.support.processes import run_cli
from tests.support.training_harness import TINY_GPT
from tests.support.workers import run_workers


@pytest.mark.slow
def test_the_default_job_ends_with_a_checkpoint_that_exports(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "hf"
    trained = run_cli("launcher", ["train.steps=3", f"train.run_dir={run_dir}"], tmp_path)
    assert trained.code == 0, trained.stderr_lines[-3:]
    assert [p.name for p in complete_checkpoints(run_dir / "checkpoints")] == ["step_00000003"]
    exported = run_cli("export", [f"run_dir={run_dir}", "format=hf", f"out={out}"], tmp_path)
    assert exported.code == 0, exported.stderr_lines[-3:]
    assert json.loads((out / "config.json").read_text())["architectures"]
    assert list(out.glob("*.safetensors"))


def test_a_finished_run_saves_once_and_a_resume_at_its_end_saves_nothing(tmp_path):
    base = TINY_GPT + ["optim=sgd", "train.steps=3", "parallel.pp=2", "checkpoint.every=2"]
    run_dir = tmp_path / "run"
    run_workers(train_full, 2, base, str(run_dir))
    root = run_dir / "checkpoints"
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000002", "step_00000003"]
    written = (root / "step_00000003" / "COMMITTED").stat().st_mtime_ns
    run_workers(train_full, 2, base + ["train.resume=auto"], str(run_dir))
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000002", "step_00000003"]
    assert (root / "step_00000003" / "COMMITTED").stat().st_mtime_ns == written   # not written again

    off = tmp_path / "off"
    run_workers(train_full, 2, base + ["checkpoint.at_end=false"], str(off))
    assert [p.name for p in complete_checkpoints(off / "checkpoints")] == ["step_00000002"]
