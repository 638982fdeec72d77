"""model=mixtral_tiny in the pipeline runtime: at pp=2 under 1f1b and dualpipev, and with a gated
shared expert, unrenormalised weights, MoE in every second block, a capacity that drops tokens, a
z-loss and full recomputation, and at dp=2 with experts that some micro-batches leave idle, the losses and parameters equal single-process training of the same objective (the mean
over micro-batches of loss + the MoE layers' auxiliary loss; fp32), whose auxiliary loss visibly
changes the parameters, so its gradient reaches the first stage too; a bf16 pipeline matches
single-process bf16 training. metrics.jsonl counts every routed token-slot per expert and the
load-balancing loss each step; summary.json the dropped slots."""
from __future__ import annotations

import pytest
import torch

from tests.distributed.test_llama_training import assert_matches_bf16_scheme
from tests.support.training_harness import TINY_GPT, assert_matches_reference, merge_params, reference_training, train_rank
from tests.support.workers import run_workers

MIXTRAL = ["model=mixtral_tiny", "model.seq_len=16", *[o for o in TINY_GPT if o.startswith("train.")],
           "train.steps=3", "optim=sgd", "train.lr=0.05", "parallel.pp=2", "model.moe.aux_loss_coef=0.1"]
SHARED = ["model.moe.shared_experts=2", "model.moe.shared_expert_ffn_hidden_size=16", "model.moe.shared_expert_gate=true",
          "model.moe.renormalize=false", "model.moe.every=2", "model.moe.capacity_factor=1.0",
          "model.moe.z_loss_coef=0.001"]
RUNS = {"1f1b": ["schedule=1f1b"],
        "dualpipev": ["schedule=dualpipev"],   # m = 4 >= 2p: two chunks per rank, the aux gradient in both
        # recomputed forwards (inside the backward) are not counted again
        "shared_capacity_every2_recompute": ["schedule=1f1b", *SHARED, "recompute.granularity=full"],
        # 16 tokens per micro-batch over 16 top-1 experts: some get none in a micro-batch, and how many
        # differs from step to step, under the overlapped reduction's buckets (dp = 2)
        "idle_experts_dp2": ["parallel.pp=1", "parallel.dp=2", "train.micro_batch_size=1", "model.moe.num_experts=16",
                             "model.moe.top_k=1", "train.overlap_grad_reduce=true"]}
BF16 = ["schedule=1f1b", "precision=bf16"]
SLOTS_PER_STEP = 8 * 16 * 2   # global batch x sequence x top_k, per MoE layer


@pytest.mark.slow
def test_moe_pipelines_match_single_process(tmp_path):
    runs = [(MIXTRAL + extra, str(tmp_path / name)) for name, extra in RUNS.items()]
    runs.append((MIXTRAL + BF16, str(tmp_path / "bf16")))
    per_rank = run_workers(train_rank, 2, runs)
    for index, (name, extra) in enumerate(RUNS.items()):
        result = {"params": merge_params([rank_results[index] for rank_results in per_rank]),
                  "losses": per_rank[0][index]["losses"]}
        assert_matches_reference(result, reference_training(MIXTRAL + extra))
    assert_matches_bf16_scheme({"params": merge_params([rank_results[-1] for rank_results in per_rank]),
                                "losses": per_rank[0][-1]["losses"]}, MIXTRAL + BF16)

    # the auxiliary loss is part of what was matched: without it the first block's router ends elsewhere
    without = reference_training(MIXTRAL + RUNS["1f1b"] + ["model.moe.aux_loss_coef=0"])["params"]
    router = "1.mlp.router.weight"
    assert (without[router] - merge_params([r[0] for r in per_rank])[router]).abs().max() > 1e-6

    dropless, dropping = per_rank[0][0], per_rank[0][2]
    for record in dropless["records"]:   # 4 MoE blocks on two stages, summed over the ranks
        assert sum(record["moe_tokens_per_expert"]) == 4 * SLOTS_PER_STEP and record["moe_tokens_dropped"] == 0
        assert record["moe_aux_loss"] > 0
    assert dropless["summary"]["moe_tokens_dropped"] == 0
    for record in dropping["records"]:   # blocks 1 and 3 (capacity: ceil(32 * 2 / 4) = 16 slots per micro-batch)
        assert sum(record["moe_tokens_per_expert"]) == 2 * SLOTS_PER_STEP
        assert record["moe_z_loss"] > 0
    assert dropping["summary"]["moe_tokens_dropped"] == sum(r["moe_tokens_dropped"] for r in dropping["records"]) > 0
    assert torch.isfinite(torch.tensor(dropping["losses"])).all()
