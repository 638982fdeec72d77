"""Tensor parallelism inside the pipeline runtime: (pp, tp, dp) layouts train exactly like the
dense single-process model, with scatter/gather on and off, with full and selective recomputation and with sequence parallelism, and
scatter/gather sends 1/t of the bytes between stages; on every layout each rank stashes less with
full than with selective recomputation, less with either than without, and less with sequence
parallelism than without."""
from __future__ import annotations

import pytest

from tests.support.stash_checks import assert_stash_grows, stash_bytes_per_microbatch
from tests.support.workers import run_workers
from tests.support.training_harness import TINY_GPT, assert_matches_reference, merge_params, reference_training, train_rank

LAYOUTS = [(1, 2, 1), (2, 2, 1), (1, 2, 2)]   # (pp, tp, dp)
SGD = ["optim=sgd", "train.lr=0.05", "model.vocab_size=255"]   # 255: the vocabulary needs padding
VARIANTS = {
    "scatter_gather": SGD,
    "plain_sends": SGD + ["comm.scatter_gather=false"],
    "recompute": SGD + ["recompute.granularity=full"],
    "selective": SGD + ["recompute.granularity=selective"],   # each rank's heads recompute their cores
    "sequence_parallel": SGD + ["parallel.sequence_parallel=true"],
}


@pytest.mark.slow
@pytest.mark.parametrize("pp,tp,dp", LAYOUTS, ids=[f"pp{p}-tp{t}-dp{d}" for p, t, d in LAYOUTS])
def test_tensor_parallel_matches_dense_single_process(tmp_path, pp, tp, dp):
    base = TINY_GPT + ["train.steps=3", "schedule=1f1b", f"parallel.pp={pp}", f"parallel.tp={tp}",
                       f"parallel.dp={dp}"]
    runs = [(base + extra, str(tmp_path / name)) for name, extra in VARIANTS.items()]
    per_rank = run_workers(train_rank, pp * tp * dp, runs)
    for index, extra in enumerate(VARIANTS.values()):
        result = merge_params([rank_results[index] for rank_results in per_rank])
        assert_matches_reference({"params": result, "losses": per_rank[0][index]["losses"]},
                                 reference_training(base + extra))
    # each rank's stash: full < selective < no recomputation; sequence parallelism keeps 1/t of
    # the LayerNorm and dropout activations
    stash = {name: stash_bytes_per_microbatch(per_rank[0][index]) for index, name in enumerate(VARIANTS)}
    assert_stash_grows({name: stash[name] for name in ("recompute", "selective", "scatter_gather")})
    assert_stash_grows({name: stash[name] for name in ("sequence_parallel", "scatter_gather")})
    if pp > 1:
        sent = [[r["bytes_sent"] for r in per_rank[0][i]["summary"]["ranks"]] for i in range(2)]
        assert [a * tp for a in sent[0]] == sent[1]   # scatter/gather: exactly 1/t of the bytes
        sequence_parallel = list(VARIANTS).index("sequence_parallel")
        # sequence parallelism: each rank sends its own part of the sequence, again 1/t, ungathered
        assert [r["bytes_sent"] for r in per_rank[0][sequence_parallel]["summary"]["ranks"]] == sent[0]


@pytest.mark.slow
def test_3d_pp2_tp2_dp2_matches_dense_single_process(tmp_path):
    base = TINY_GPT + ["train.steps=3", "schedule=1f1b", "parallel.pp=2", "parallel.tp=2", "parallel.dp=2"] + SGD
    per_rank = run_workers(train_rank, 8, [(base, str(tmp_path / "3d"))], timeout=600)
    result = merge_params([r[0] for r in per_rank])
    assert_matches_reference({"params": result, "losses": per_rank[0][0]["losses"]}, reference_training(base))


@pytest.mark.slow
def test_every_schedule_runs_tensor_parallel(tmp_path):
    """gpipe and interleaved equal dense training with tp = 2; 2bw with tp = 2 equals 2bw with tp = 1
    (whose update rule tests/test_async_training.py checks against its reference)."""
    base = TINY_GPT + ["train.steps=3", "parallel.pp=2", "parallel.tp=2"] + SGD
    sync = {"gpipe": ["schedule=gpipe"], "interleaved": ["schedule=interleaved", "parallel.vpp=2"]}
    two_bw = ["schedule=2bw", "model.tie_embeddings=false"]
    runs = [(base + extra, str(tmp_path / name)) for name, extra in sync.items()]
    runs.append((base + two_bw, str(tmp_path / "2bw_tp2")))
    per_rank = run_workers(train_rank, 4, runs)
    for index, extra in enumerate(sync.values()):
        result = merge_params([rank_results[index] for rank_results in per_rank])
        assert_matches_reference({"params": result, "losses": per_rank[0][index]["losses"]},
                                 reference_training(base + extra))
    dense_2bw = run_workers(train_rank, 2, [([o for o in base if o != "parallel.tp=2"] + two_bw,
                                             str(tmp_path / "2bw_tp1"))])
    assert_matches_reference({"params": merge_params([r[2] for r in per_rank]), "losses": per_rank[0][2]["losses"]},
                             {"params": merge_params([r[0] for r in dense_2bw]), "losses": dense_2bw[0][0]["losses"]})
