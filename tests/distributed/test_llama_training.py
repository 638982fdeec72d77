"""model=llama in the pipeline runtime: 1F1B, interleaved and zb_h2 pipelines, and tensor
parallelism with grouped-query attention (key/value heads split over t, and one replicated per
rank when t exceeds them), give the losses and parameters of single-process training (fp32);
a bf16 pipeline trains with finite losses."""
from __future__ import annotations

import math

import pytest

from tests.support.training_harness import TINY_GPT, assert_matches_reference, merge_params, reference_training, train_rank
from tests.support.workers import run_workers

TINY_LLAMA = ["model=llama_tiny", "model.num_layers=6", "model.hidden_size=32", "model.num_heads=4",
              "model.num_kv_heads=2", "model.ffn_hidden_size=64", "model.seq_len=16",
              *[o for o in TINY_GPT if o.startswith("train.")], "train.steps=3", "optim=sgd", "train.lr=0.05",
              "parallel.pp=2"]
TP2 = ["parallel.tp=2", "model.vocab_size=255"]   # 255: the vocabulary needs padding
RUNS = {   # world size -> run name -> overrides; every run compared with single-process training
    2: {"interleaved_tied_selective": ["schedule=interleaved", "parallel.vpp=2", "model.tie_embeddings=true",
                                       "recompute.granularity=selective"],
        "zb_h2": ["schedule=zb_h2", "recompute.granularity=full"]},
    4: {"1f1b_tp2_kv_split": ["schedule=1f1b", *TP2],
        "zb_h2_tp2_kv_replicated": ["schedule=zb_h2", "model.num_kv_heads=1", *TP2]},
}
BF16 = ["schedule=1f1b", "precision=bf16"]


@pytest.mark.slow
@pytest.mark.parametrize("world", RUNS)
def test_llama_pipelines_match_single_process(tmp_path, world):
    runs = [(TINY_LLAMA + extra, str(tmp_path / name)) for name, extra in RUNS[world].items()]
    if world == 2:
        runs.append((TINY_LLAMA + BF16, str(tmp_path / "bf16")))
    per_rank = run_workers(train_rank, world, runs)
    for index, (name, extra) in enumerate(RUNS[world].items()):
        result = merge_params([rank_results[index] for rank_results in per_rank])
        assert_matches_reference({"params": result, "losses": per_rank[0][index]["losses"]},
                                 reference_training(TINY_LLAMA + extra))
    if world == 2:
        bf16_losses = per_rank[0][-1]["losses"]
        assert len(bf16_losses) == 3 and all(math.isfinite(loss) for loss in bf16_losses)
        assert bf16_losses != reference_training(TINY_LLAMA + ["schedule=1f1b"])["losses"]   # it ran in bf16
