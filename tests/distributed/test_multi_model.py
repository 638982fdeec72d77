"""A fused model set trains each of its K models exactly as K separate single-process runs would
(losses and final weights, fp32), under pp=1 and pp=2."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipedream.multi_model.export import split_models
from tests.support.checkpoint_harness import train_full, train_interrupted
from tests.support.training_harness import TINY_GPT, assert_matches_reference, merge_params, reference_training, train_rank
from tests.support.workers import run_workers

STEPS = 3
# per-model overrides: each model its own seed (weights, data set and order); the two models share
# their learning rate and weight decay (so their optimizer groups), of the four two do and the others not
OVERRIDES = {2: "[{seed:11,lr:0.003},{seed:12,lr:0.003}]",
             4: "[{seed:11,lr:0.003},{seed:12,lr:0.001},{seed:13,lr:0.003},{seed:14,lr:0.004,weight_decay:0.0}]"}
LR = {2: [0.003, 0.003], 4: [0.003, 0.001, 0.003, 0.004]}
BASE = TINY_GPT + [f"train.steps={STEPS}", "optim=adamw", "model.tie_embeddings=true", "train.grad_clip=0.05"]


def alone_overrides(count: int, k: int) -> list[str]:
    seed = 11 + k
    extra = ["optim.weight_decay=0.0"] if count == 4 and k == 3 else []
    return BASE + [f"train.seed={seed}", f"train.lr={LR[count][k]}"] + extra


def unstacked(params: dict) -> dict:
    """``<layer>.body.<name>`` stacks ([K, ...]) as ``<layer>.models.<k>.<name>``, model by model."""
    out = {}
    for key, value in params.items():
        layer, _, name = key.partition(".body.")
        for k in range(value.shape[0]):
            out[f"{layer}.models.{k}.{name}"] = value[k]
    return out


def check_each_model(per_rank: list, count: int) -> None:
    merged = unstacked(merge_params([r[0] for r in per_rank]))
    metrics = per_rank[0][0]["summary"]["models"]
    for k, params in enumerate(split_models(merged)):
        reference = reference_training(alone_overrides(count, k))
        losses = [record["models"][k]["loss"] for record in per_rank[0][0]["records"]]
        assert_matches_reference({"params": params, "losses": losses}, reference, atol=1e-5)
        assert metrics[k]["seed"] == 11 + k and metrics[k]["lr"] == LR[count][k]


@pytest.mark.slow
@pytest.mark.parametrize("count", [2, 4])
@pytest.mark.parametrize("pp", [1, 2])
def test_fused_models_match_separate_runs(tmp_path, count, pp):
    fused = BASE + [f"parallel.pp={pp}", f"train.models={OVERRIDES[count]}"]
    check_each_model(run_workers(train_rank, pp, [(fused, str(tmp_path / "fused"))]), count)


@pytest.mark.slow
def test_fused_models_with_data_parallelism_and_fixed_partial_fusion(tmp_path):
    fused = BASE + ["parallel.pp=1", "parallel.dp=2", f"train.models={OVERRIDES[4]}", "train.fusion_groups=2"]
    check_each_model(run_workers(train_rank, 2, [(fused, str(tmp_path / "fused"))]), 4)


@pytest.mark.slow
def test_resumed_fused_run_exports_each_model(tmp_path):
    """Stopped after the step-2 checkpoint, resumed to step 3, exported: model_<k>.pt holds model
    k's weights as its own run trains them."""
    from pipedream.export import export

    run_dir = tmp_path / "fused"
    fused = BASE + ["parallel.pp=2", f"train.models={OVERRIDES[2]}", "checkpoint.every=1"]
    assert run_workers(train_interrupted, 2, fused, str(run_dir), 2) == ["stopped"] * 2
    run_workers(train_full, 2, fused + ["train.resume=auto"], str(run_dir))
    written = export(run_dir)
    assert [p.name for p in written if p.suffix == ".pt"] == ["model_0.pt", "model_1.pt"]
    for k in range(2):
        exported = torch.load(Path(run_dir) / f"model_{k}.pt")
        reference = reference_training(alone_overrides(2, k))["params"]
        assert set(exported) == set(reference)
        for name, value in reference.items():
            torch.testing.assert_close(exported[name], value, rtol=1e-5, atol=1e-5)


def _memory_run(tmp_path: Path, name: str, pp: int, budget: int, layout: list[str]) -> list:
    fused = BASE + layout + [f"parallel.pp={pp}", f"train.models={OVERRIDES[2]}", "train.fusion_groups=2",
                             f"memory.device_budget_bytes={budget}"]
    return run_workers(train_rank, pp, [(fused, str(tmp_path / name))])


@pytest.mark.slow
@pytest.mark.parametrize("pp,layout", [(1, []), (2, []), (2, ["schedule=interleaved", "parallel.vpp=2"])],
                         ids=["pp1", "pp2", "interleaved"])
def test_a_budget_below_the_unoptimised_peak_is_kept_and_training_still_matches(tmp_path, pp, layout):
    """First the peak with every feature map kept (a budget nothing reaches), then a budget between
    the smallest feasible peak and that: the device tier's own count stays within it on every
    rank, some maps are swapped or recomputed, and each model still trains as alone."""
    unbounded = _memory_run(tmp_path, "unbounded", pp, 1 << 40, layout)[0][0]["summary"]["fused_stages"]
    assert all(stage["decisions"] == {} for stage in unbounded)
    peaks = [stage["peak_resident_bytes"] for stage in unbounded]
    # the memory simulator predicts the tier's count exactly when everything is kept
    assert peaks == [stage["simulated_unoptimised_peak_bytes"] for stage in unbounded]
    budget = int(max(peaks) * 0.8)
    per_rank = _memory_run(tmp_path, "budget", pp, budget, layout)
    stages = per_rank[0][0]["summary"]["fused_stages"]
    for stage, unoptimised in zip(stages, peaks):
        assert stage["peak_resident_bytes"] <= stage["simulated_peak_bytes"] <= budget
        if unoptimised > budget:
            assert set(stage["decisions"].values()) <= {"swap", "recompute"} and stage["decisions"]
    check_each_model(per_rank, 2)
