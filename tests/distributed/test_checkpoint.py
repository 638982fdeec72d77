"""Checkpoints: a resumed run continues exactly as if uninterrupted, into the same or another
layout, from the step after its checkpoint (metrics.jsonl as logged); incomplete or truncated
checkpoints are skipped; the export loads into the plain model."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.checkpoint_harness import logged_losses, losses_across_resume, train_full, train_interrupted
from tests.support.workers import run_workers
from tests.support.training_harness import TINY_GPT, assert_matches_reference, merge_params

STEPS, STOP = 4, 2   # stopped after the checkpoint of step 2 of 4, then resumed
BASE = TINY_GPT + ["optim=sgd", "train.lr=0.05", f"train.steps={STEPS}", "checkpoint.every=2"]
ASYNC = ["model.tie_embeddings=false"]


def uninterrupted(tmp_path: Path, layout: list[str], world: int) -> dict:
    per_rank = run_workers(train_full, world, BASE + layout, str(tmp_path / "full"))
    return {"params": merge_params(per_rank), "losses": logged_losses(tmp_path / "full", STEPS)}


@pytest.mark.slow
@pytest.mark.parametrize("layout,world", [(["parallel.pp=2"], 2), (["parallel.pp=1", "parallel.dp=2"], 2),
                                          (["parallel.pp=2", "schedule=2bw", *ASYNC], 2)],
                         ids=["pp2", "dp2", "2bw"])
def test_resume_continues_exactly(tmp_path, layout, world):
    expected = uninterrupted(tmp_path, layout, world)
    run_dir = tmp_path / "resumed"
    assert run_workers(train_interrupted, world, BASE + layout, str(run_dir), STOP) == ["stopped"] * world
    per_rank = run_workers(train_full, world, BASE + layout + ["train.resume=auto"], str(run_dir))
    result = {"params": merge_params(per_rank), "losses": losses_across_resume(run_dir, STOP, STEPS)}
    # fp32 on CPU, same layout: bit for bit
    assert result["losses"] == expected["losses"]
    for name, value in expected["params"].items():
        assert torch.equal(result["params"][name], value), name


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(["parallel.pp=2"], ["parallel.pp=1"]),
                                          (["parallel.pp=1", "parallel.dp=1"], ["parallel.pp=2"]),
                                          (["parallel.pp=1", "parallel.dp=1"], ["parallel.pp=1", "parallel.dp=2"])],
                         ids=["pp2-to-pp1", "pp1-to-pp2", "dp1-to-dp2"])
def test_resume_into_another_layout(tmp_path, before, after):
    world_before = 2 if "parallel.pp=2" in before else 1
    world_after = 2 if ("parallel.dp=2" in after or "parallel.pp=2" in after) else 1
    expected = uninterrupted(tmp_path, before, world_before)
    run_dir = tmp_path / "resharded"
    run_workers(train_interrupted, world_before, BASE + before, str(run_dir), STOP)
    per_rank = run_workers(train_full, world_after, BASE + after + ["train.resume=auto"], str(run_dir))
    assert_matches_reference({"params": merge_params(per_rank), "losses": losses_across_resume(run_dir, STOP, STEPS)},
                             expected)


@pytest.mark.slow
def test_truncated_checkpoint_is_skipped_and_export_loads(tmp_path):
    from models import build_model
    from pipedream.checkpoint.store import complete_checkpoints
    from pipedream.data.datasets import build_datasets
    from pipedream.data.batching import GlobalBatchOrder, microbatches
    from pipedream.export import export
    from tests.support.training_harness import compose_config

    run_dir = tmp_path / "run"
    overrides = BASE + ["parallel.pp=2", "checkpoint.every=1", "checkpoint.keep=3", "train.eval_batches=2"]
    run_workers(train_interrupted, 2, overrides, str(run_dir), 3)
    root = run_dir / "checkpoints"
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000001", "step_00000002", "step_00000003"]
    shard = sorted((root / "step_00000003").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.warns(UserWarning, match="truncated"):
        assert [p.name for p in complete_checkpoints(root)][-1] == "step_00000002"
    per_rank = run_workers(train_full, 2, overrides + ["train.resume=auto"], str(run_dir))  # warns in the ranks
    losses_across_resume(run_dir, 3, STEPS, resumed_after=2)   # step 3 ran again, from the step-2 checkpoint
    summary = per_rank[0]["summary"]

    # the consolidated export reproduces the run's validation loss in one plain process
    written = export(run_dir)
    cfg = compose_config(overrides)
    network = build_model(cfg.model, seed=0).build_sequential()
    network.load_state_dict(torch.load(written[0]))
    model = build_model(cfg.model)
    _, val_set = build_datasets(cfg.model, cfg.data, int(cfg.train.seed))
    order = GlobalBatchOrder(len(val_set), int(cfg.train.global_batch_size), int(cfg.train.seed))
    with torch.no_grad():
        val = [sum(float(model.loss_fn(network(x), y)) for x, y in parts) / len(parts)
               for parts in (microbatches(val_set, order.indices(i), 2) for i in range(2))]
    assert sum(val) / len(val) == pytest.approx(summary["final_val_loss"], rel=1e-5)


@pytest.mark.slow
def test_tensor_parallel_checkpoint_reshards_to_dense(tmp_path):
    """tp = 2 shards are saved as dense tensors: a tp = 2 run resumes into tp = 1 and matches."""
    layout = ["parallel.pp=1", "parallel.tp=2", "model.vocab_size=255"]
    expected = uninterrupted(tmp_path, layout, 2)
    run_dir = tmp_path / "tp"
    run_workers(train_interrupted, 2, BASE + layout, str(run_dir), STOP)
    per_rank = run_workers(train_full, 1, BASE + ["parallel.pp=1", "model.vocab_size=255", "train.resume=auto"],
                           str(run_dir))
    assert_matches_reference({"params": merge_params(per_rank), "losses": losses_across_resume(run_dir, STOP, STEPS)},
                             expected)
