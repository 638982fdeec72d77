"""model=llama in the pipeline runtime: 1F1B, interleaved and zb_h2 pipelines, and tensor
parallelism with grouped-query attention (key/value heads split over t, and one replicated per
rank when t exceeds them), with and without sequence parallelism and recomputation, give the
losses and parameters of single-process training (fp32); at (pp, tp) = (1, 2) each rank stashes
less with full than with selective recomputation, less with either than without, and less with
sequence parallelism than without; a bf16 pipeline matches single-process training under the same
bf16 scheme (test_mixed_precision's tolerance, which fp32 training is far outside)."""
from __future__ import annotations

import pytest
import torch

from tests.distributed.test_mixed_precision import TOLERANCE
from tests.support.stash_checks import assert_stash_grows, stash_bytes_per_microbatch
from tests.support.training_harness import TINY_GPT, assert_matches_reference, merge_params, reference_training, train_rank
from tests.support.workers import run_workers

TINY_LLAMA = ["model=llama_tiny", "model.num_layers=6", "model.hidden_size=32", "model.num_heads=4",
              "model.num_kv_heads=2", "model.ffn_hidden_size=64", "model.seq_len=16",
              *[o for o in TINY_GPT if o.startswith("train.")], "train.steps=3", "optim=sgd", "train.lr=0.05",
              "parallel.pp=2"]
TP2 = ["parallel.tp=2", "model.vocab_size=255"]   # 255: the vocabulary needs padding
SP = ["parallel.sequence_parallel=true"]
PP1 = ["parallel.pp=1"]   # replaces TINY_LLAMA's parallel.pp=2 (``configured``)
RUNS = {   # world size -> run name -> overrides; every run compared with single-process training
    2: {"interleaved_tied_selective": ["schedule=interleaved", "parallel.vpp=2", "model.tie_embeddings=true",
                                       "recompute.granularity=selective"],
        "zb_h2": ["schedule=zb_h2", "recompute.granularity=full"],
        "pp1_tp2_sequence_parallel": ["schedule=1f1b", *PP1, *TP2, *SP],
        # the stash baselines of sequence parallelism and recomputation at the same layout
        "pp1_tp2": ["schedule=1f1b", *PP1, *TP2],
        "pp1_tp2_full": ["schedule=1f1b", *PP1, *TP2, "recompute.granularity=full"],
        "pp1_tp2_selective": ["schedule=1f1b", *PP1, *TP2, "recompute.granularity=selective"]},
    4: {"1f1b_tp2_kv_split": ["schedule=1f1b", *TP2],
        "zb_h2_tp2_kv_replicated": ["schedule=zb_h2", "model.num_kv_heads=1", *TP2],
        "1f1b_tp2_sequence_parallel_kv_replicated": ["schedule=1f1b", "model.num_kv_heads=1", *TP2, *SP]},
}


def configured(extra: list[str]) -> list[str]:
    base = [o for o in TINY_LLAMA if not (o.startswith("parallel.pp=") and any(e.startswith("parallel.pp=")
                                                                              for e in extra))]
    return base + extra
BF16 = ["schedule=1f1b", "precision=bf16"]


@pytest.mark.slow
@pytest.mark.parametrize("world", RUNS)
def test_llama_pipelines_match_single_process(tmp_path, world):
    runs = [(configured(extra), str(tmp_path / name)) for name, extra in RUNS[world].items()]
    if world == 2:
        runs.append((TINY_LLAMA + BF16, str(tmp_path / "bf16")))
    per_rank = run_workers(train_rank, world, runs)
    for index, (name, extra) in enumerate(RUNS[world].items()):
        result = merge_params([rank_results[index] for rank_results in per_rank])
        assert_matches_reference({"params": result, "losses": per_rank[0][index]["losses"]},
                                 reference_training(configured(extra)))
    if world == 2:
        stash = {name: stash_bytes_per_microbatch(per_rank[0][index]) for index, name in enumerate(RUNS[2])}
        assert_stash_grows({name: stash[name] for name in ("pp1_tp2_full", "pp1_tp2_selective", "pp1_tp2")})
        assert_stash_grows({name: stash[name] for name in ("pp1_tp2_sequence_parallel", "pp1_tp2")})
        assert_matches_bf16_scheme({"params": merge_params([rank_results[-1] for rank_results in per_rank]),
                                    "losses": per_rank[0][-1]["losses"]}, TINY_LLAMA + BF16)


def assert_matches_bf16_scheme(result: dict, overrides: list[str]) -> None:
    """Equals single-process training under the same bf16 scheme at test_mixed_precision's
    tolerance, which fp32 training's weights are far outside (so the comparison can fail)."""
    reference = reference_training(overrides)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]),
                               rtol=TOLERANCE["loss_rtol"], atol=0)
    assert set(result["params"]) == set(reference["params"])
    for name, expected in reference["params"].items():
        torch.testing.assert_close(result["params"][name], expected, rtol=TOLERANCE["rtol"], atol=TOLERANCE["atol"],
                                   msg=name)
    fp32 = reference_training([o for o in overrides if not o.startswith("precision=")])["params"]
    assert max((fp32[name] - value).abs().max().item() for name, value in reference["params"].items()) \
        > 10 * TOLERANCE["atol"]
