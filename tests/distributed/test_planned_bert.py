"""A planner plan file trains BERT: plan bert_tiny for two processes, run the training entry point
with ``parallel.plan=...`` on pp=2, and get single-process training's losses."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipedream.config.plan_file import load_plan
from tests.support.training_harness import compose_config, reference_training
from tests.support.workers import run_workers

MODEL = ["model=bert_tiny", "model.hidden_size=32", "model.num_heads=2", "model.seq_len=16"]
TRAIN = ["train.steps=3", "train.warmup_steps=1", "train.eval_every=0", "train.eval_batches=1", "train.log_every=1",
         "train.progress=false", "train.timeout_s=60", "optim=sgd", "train.lr=0.05"]


def planned_rank(rank: int, world_size: int, overrides: list[str]) -> int:
    """The torchrun entry point's own path: plan checks, plan applied, run spec, training."""
    from pipedream.train import run

    return run(compose_config(overrides))


@pytest.mark.slow
def test_bert_trains_from_a_planner_plan(tmp_path, capsys):
    from planner.__main__ import main as planner_main

    plan_path, run_dir = tmp_path / "plan.json", tmp_path / "run"
    assert planner_main(MODEL + ["cluster=local_cpu", "train.global_batch_size=8", "planner.pp=2",
                                 f"planner.out={plan_path}"]) == 0, capsys.readouterr().err
    plan = load_plan(plan_path)
    assert plan.parallel.pp == 2 and plan.model.num_layers == 4  # embedding, 2 blocks, MLM head

    overrides = MODEL + TRAIN + ["train.global_batch_size=8", f"parallel.plan={plan_path}", f"train.run_dir={run_dir}"]
    assert run_workers(planned_rank, plan.world_size, overrides, timeout=240) == [0] * plan.world_size

    summary = json.loads(Path(run_dir, "summary.json").read_text())
    assert summary["parallel"]["pp"] == 2 and summary["schedule"] == plan.schedule
    assert summary["stages"] == [list(stage.layers) for stage in plan.stages]
    losses = [json.loads(line)["loss"] for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    batch = [f"train.global_batch_size={plan.batch.global_batch}", f"train.micro_batch_size={plan.batch.micro}"]
    reference = reference_training(MODEL + TRAIN + batch)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)
