"""Mixed precision across processes: bf16 pipelines match the same scheme in one process; boundary
tensors travel in half of fp32's bytes; fp16 loss scaling is agreed by every rank (an overflow on
one rank skips the step everywhere), grows after clean steps, and resumes exactly."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.support.async_reference import pipedream_reference, two_bw_reference
from tests.support.checkpoint_harness import train_full, train_interrupted
from tests.support.precision_harness import overflow_run
from tests.support.training_harness import TINY_GPT, compose_config, merge_params, reference_training, train_rank
from tests.support.workers import run_workers

BASE = TINY_GPT + ["train.steps=3", "optim=sgd", "train.lr=0.05", "model.tie_embeddings=false"]
# Without tensor parallelism a pipeline runs the reference's operations on the same tensors (one
# thread each, as the tests run): losses are bitwise the reference's and parameters differ at fp32
# rounding (measured 4e-9: the summation order of gradients), so the fp32 harness's tolerance holds.
# Tensor parallelism rounds each rank's partial sum to bf16 before the all-reduce (as Megatron
# does), where the dense GEMM rounds once: differences at bf16's rounding (2^-8 relative) from the
# first step; measured 4e-5 relative in the losses and 7e-5 in the parameters after 3 steps. Its
# tolerance is about 5x those.
TOLERANCE = {"atol": 1e-6, "rtol": 1e-5, "loss_rtol": 0.0}
TP_TOLERANCE = {"atol": 5e-4, "rtol": 1e-2, "loss_rtol": 2e-4}

WORLD2 = {"1f1b-pp2": ["parallel.pp=2"], "interleaved-pp2-v2": ["schedule=interleaved", "parallel.pp=2",
                                                                 "parallel.vpp=2"]}
WORLD4 = {"1f1b-pp2-dp2": ["parallel.pp=2", "parallel.dp=2"], "1f1b-pp2-tp2": ["parallel.pp=2", "parallel.tp=2"]}


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("world,layouts", [(2, WORLD2), (4, WORLD4)], ids=["world2", "world4"])
def test_bf16_pipelines_match_the_single_process_bf16_scheme(tmp_path, world, layouts):
    runs = [(BASE + ["precision=bf16"] + layout, str(tmp_path / name)) for name, layout in layouts.items()]
    first = next(iter(layouts.values()))
    runs.append((BASE + ["precision=fp32"] + first, str(tmp_path / "fp32")))   # the byte and scheme baseline
    per_rank = run_workers(train_rank, world, runs)
    reference = reference_training(BASE + ["precision=bf16"])
    expected_losses = torch.tensor(reference["losses"])
    for index, name in enumerate(layouts):
        tolerance = TP_TOLERANCE if "tp2" in name else TOLERANCE
        params = merge_params([rank[index] for rank in per_rank])
        result_losses = torch.tensor(per_rank[0][index]["losses"])
        torch.testing.assert_close(result_losses, expected_losses, rtol=tolerance["loss_rtol"], atol=0, msg=name)
        assert set(params) == set(reference["params"])
        for key, expected in reference["params"].items():
            torch.testing.assert_close(params[key], expected, rtol=tolerance["rtol"], atol=tolerance["atol"],
                                       msg=f"{name} {key}")
    # the tolerance tells the schemes apart: fp32 training is far outside it
    fp32_params = merge_params([rank[-1] for rank in per_rank])
    assert max((fp32_params[key] - value).abs().max().item() for key, value in reference["params"].items()) \
        > 10 * TOLERANCE["atol"]
    assert per_rank[0][-1]["losses"][0] != reference["losses"][0]

    # boundary tensors (activations and their gradients) travel in bf16: half of fp32's bytes
    bf16_ranks, fp32_ranks = per_rank[0][0]["summary"]["ranks"], per_rank[0][-1]["summary"]["ranks"]
    for bf16, fp32 in zip(bf16_ranks, fp32_ranks):
        assert fp32["comm"]["bytes_sent_per_step"] > 0
        assert bf16["comm"]["bytes_sent_per_step"] * 2 == fp32["comm"]["bytes_sent_per_step"]
        assert bf16["comm"]["bytes_received_per_step"] * 2 == fp32["comm"]["bytes_received_per_step"]


@pytest.mark.slow
def test_bf16_asynchronous_schedules_match_their_references(tmp_path):
    """pipedream and 2bw in bf16 against tests/support/async_reference.py under the same scheme (fp16 is
    refused for them: tests/unit/numerics/test_precision.py)."""
    runs = {"2bw": BASE + ["precision=bf16", "schedule=2bw", "parallel.pp=2", "train.steps=4"],
            "pipedream": BASE + ["precision=bf16", "schedule=pipedream", "parallel.pp=2", "train.steps=4"]}
    per_rank = run_workers(train_rank, 2, [(overrides, str(tmp_path / name)) for name, overrides in runs.items()])
    references = {"2bw": two_bw_reference(compose_config(runs["2bw"]), 1),
                  "pipedream": pipedream_reference(compose_config(runs["pipedream"]), [1, 1])}
    for index, name in enumerate(runs):
        params = merge_params([rank[index] for rank in per_rank])
        for key, expected in references[name].final_params().items():
            torch.testing.assert_close(params[key], expected, rtol=TOLERANCE["rtol"], atol=TOLERANCE["atol"],
                                       msg=f"{name} {key}")


FP16 = TINY_GPT + ["precision=fp16", "precision.initial_scale=1024", "precision.growth_interval=2", "train.steps=5",
                   "optim=adamw", "model.tie_embeddings=false"]


@pytest.mark.slow
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """pp2 x dp2 and pp2 x tp2: one rank (the last) gets an inf in one gradient at step 2, after
    the gradient sync, so no other rank sees it locally."""
    runs = [(FP16 + ["parallel.pp=2", "parallel.dp=2", f"train.run_dir={tmp_path / 'dp'}"], 3, 2),
            (FP16 + ["parallel.pp=2", "parallel.tp=2", f"train.run_dir={tmp_path / 'tp'}"], 3, 2)]
    per_rank = run_workers(overflow_run, 4, runs)
    for index in range(len(runs)):
        for rank, results in enumerate(per_rank):
            result = results[index]
            # clean, overflow (x0.5), clean, clean (2 clean in a row: x2), clean
            assert result["scales"] == [1024.0, 512.0, 512.0, 1024.0, 1024.0], (index, rank)
            assert result["skipped"] == 1
            assert not any(result["changed"][1]), (index, rank)   # step 2: every weight unchanged
            for step in (0, 2, 3, 4):                           # training continues everywhere
                assert all(result["changed"][step]), (index, rank, step)
            assert all(math.isfinite(loss) for loss in result["losses"])


@pytest.mark.slow
def test_fp16_resume_restores_the_loss_scale_exactly(tmp_path):
    # growth_interval=1 changes the scale every clean step, so a scale that was not restored shows
    layout = TINY_GPT + ["precision=fp16", "precision.initial_scale=256", "precision.growth_interval=1",
                         "optim=sgd", "train.lr=0.05", "train.steps=4", "checkpoint.every=2", "parallel.pp=2"]
    full = run_workers(train_full, 2, layout, str(tmp_path / "full"))
    run_dir = tmp_path / "resumed"
    assert run_workers(train_interrupted, 2, layout, str(run_dir), 2) == ["stopped"] * 2
    resumed = run_workers(train_full, 2, layout + ["train.resume=auto"], str(run_dir))
    assert resumed[0]["loss_scaler"] == full[0]["loss_scaler"] == resumed[1]["loss_scaler"]
    assert full[0]["loss_scaler"]["scale"] != 256.0
    assert losses(run_dir) == losses(tmp_path / "full")
    expected, result = merge_params(full), merge_params(resumed)
    for name, value in expected.items():
        assert torch.equal(result[name], value), name
