"""A model of torch's own modules (``nn.TransformerEncoderLayer`` blocks, whose attention
projections no fused Linear covers) given as a plugin trains under the zero-bubble schedules with
its weight gradients split off into W (``pipedream/runtime/weight_split.py``), and equals
single-process training (fp32): zb_h2 and zbv at pp=2, zb_h2 with the fused Linear off (every
weight through the split), and zb_h2 at pp=2, dp=2 with gradient buckets reduced during the backward."""
from __future__ import annotations

import pytest

from tests.support.training_harness import assert_matches_reference, merge_params, reference_training, train_rank
from tests.support.workers import run_workers

PLUGIN = "scripts.bench.runtime_stock_model"
BASE = [f"model._target_={PLUGIN}.build", "model.width=16", "model.heads=2", "model.blocks=2", "model.seq_len=8",
        "model.vocab=16", f"data._target_={PLUGIN}.data", "data.vocab=16", "data.seq_len=8",
        "train.global_batch_size=8", "train.micro_batch_size=2", "train.steps=3", "train.warmup_steps=1",
        "train.eval_every=0", "train.eval_batches=1", "train.log_every=1", "train.progress=false",
        "train.timeout_s=60", "optim=sgd", "train.lr=0.05", "parallel.pp=2"]
RUNS = {"zb_h2": ["schedule=zb_h2"], "zbv": ["schedule=zbv"],
        "zb_h2-unfused": ["schedule=zb_h2", "train.fuse_grad_accumulation=false"]}


@pytest.mark.slow
def test_stock_module_plugin_zero_bubble_matches_single_process(tmp_path):
    per_rank = run_workers(train_rank, 2, [(BASE + extra, str(tmp_path / name)) for name, extra in RUNS.items()])
    for index, extra in enumerate(RUNS.values()):
        result = merge_params([rank_results[index] for rank_results in per_rank])
        assert any(".self_attn.in_proj_weight" in name for name in result)
        assert_matches_reference({"params": result, "losses": per_rank[0][index]["losses"]},
                                 reference_training(BASE + extra))


@pytest.mark.slow
def test_stock_module_split_with_data_parallel_buckets_matches_single_process(tmp_path):
    """dp = 2 with the buckets reduced during the backward (the default): the split parameters'
    gradients arrive in W through autograd and the fused layers' biases in B by hand; the averaged
    gradients equal one process's."""
    extra = ["schedule=zb_h2", "parallel.dp=2", "train.global_batch_size=16", "train.overlap_grad_reduce=true"]
    per_rank = run_workers(train_rank, 4, [(BASE + extra, str(tmp_path / "dp2"))])
    result = merge_params([rank_results[0] for rank_results in per_rank])
    assert_matches_reference({"params": result, "losses": per_rank[0][0]["losses"]}, reference_training(BASE + extra))
