"""The gold standard: every synchronous schedule, on every (pp, dp, vpp) layout, gives the same
losses and parameters as single-process training on the same global batches (fp32)."""
from __future__ import annotations

import pytest

from tests.support.stash_checks import assert_stash_grows, stash_bytes_per_microbatch
from tests.support.workers import run_workers
from tests.support.training_harness import TINY_GPT, assert_matches_reference, merge_params, reference_training, train_rank

# (schedule, pp, dp, vpp)
LAYOUTS = [
    ("gpipe", 2, 1, 1), ("gpipe", 4, 1, 1), ("gpipe", 2, 2, 1),
    ("1f1b", 1, 2, 1), ("1f1b", 2, 1, 1), ("1f1b", 4, 1, 1), ("1f1b", 2, 2, 1),
    ("interleaved", 2, 1, 2), ("interleaved", 4, 1, 2),
]
# SGD keeps the comparison at rounding level; Adam divides by sqrt(v) and turns 1e-12 differences
# in near-zero gradients into 1e-6 differences in weights, so it gets one check with a wider atol.
SGD = ["optim=sgd", "train.lr=0.05"]
VARIANTS = {
    "untied": SGD + ["model.tie_embeddings=false"],
    "recompute": SGD + ["model.tie_embeddings=false", "recompute.granularity=full"],
    "tied": SGD + ["model.tie_embeddings=true"],
    "adamw": ["optim=adamw", "model.tie_embeddings=true"],
}
ATOL = {"adamw": 1e-5}
STEPS = 3


@pytest.mark.slow
@pytest.mark.parametrize("schedule,pp,dp,vpp", LAYOUTS, ids=[f"{s}-pp{p}-dp{d}-v{v}" for s, p, d, v in LAYOUTS])
def test_gpt_matches_single_process(tmp_path, schedule, pp, dp, vpp):
    base = TINY_GPT + [f"train.steps={STEPS}", f"schedule={schedule}", f"parallel.pp={pp}",
                       f"parallel.dp={dp}", f"parallel.vpp={vpp}"]
    runs = [(base + extra, str(tmp_path / name)) for name, extra in VARIANTS.items()]
    per_rank = run_workers(train_rank, pp * dp, runs)
    for index, (name, extra) in enumerate(VARIANTS.items()):
        result = merge_params([rank_results[index] for rank_results in per_rank])
        reference = reference_training(base + extra)
        assert_matches_reference({"params": result, "losses": per_rank[0][index]["losses"]}, reference,
                                 atol=ATOL.get(name, 1e-6))


@pytest.mark.slow
def test_mlp_matches_single_process(tmp_path):
    base = ["model=mlp", "data=synthetic", "model.num_layers=4", "model.hidden_size=16", "train.global_batch_size=16",
            "train.micro_batch_size=2", "train.steps=3", "train.eval_every=0", "train.log_every=1",
            "train.progress=false", "optim=sgd", "parallel.pp=2", "parallel.dp=1"]
    per_rank = run_workers(train_rank, 2, [(base, str(tmp_path / "mlp"))])
    result = merge_params([r[0] for r in per_rank])
    assert_matches_reference({"params": result, "losses": per_rank[0][0]["losses"]}, reference_training(base))



TINY_BERT = [o.replace("model=gpt_tiny", "model=bert_tiny") for o in TINY_GPT]


@pytest.mark.slow
def test_selective_and_partial_recompute_match_single_process_and_save_less(tmp_path):
    """recompute.granularity=selective recomputes only the attention cores, recompute.num_layers=1 only
    each stage's first layer: values are unchanged, and each stage saves fewer bytes per micro-batch
    than without recomputation and more than recomputing every layer."""
    pipeline = SGD + [f"train.steps={STEPS}", "parallel.pp=2", "parallel.dp=1"]
    runs = {"gpt-1f1b": TINY_GPT + pipeline + ["schedule=1f1b", "recompute.granularity=selective"],
            "gpt-interleaved": TINY_GPT + pipeline + ["schedule=interleaved", "parallel.vpp=2",
                                                      "recompute.granularity=selective"],
            "bert-1f1b": TINY_BERT + pipeline + ["schedule=1f1b", "recompute.granularity=selective"],
            "gpt-1f1b-full-1": TINY_GPT + pipeline + ["schedule=1f1b", "recompute.granularity=full",
                                                      "recompute.num_layers=1"],
            "gpt-1f1b-none": TINY_GPT + pipeline + ["schedule=1f1b", "recompute.granularity=none"],
            "gpt-1f1b-full": TINY_GPT + pipeline + ["schedule=1f1b", "recompute.granularity=full"]}
    per_rank = run_workers(train_rank, 2, [(config, str(tmp_path / name)) for name, config in runs.items()])
    for index, (name, config) in enumerate(list(runs.items())[:4]):
        result = merge_params([rank_results[index] for rank_results in per_rank])
        reference = reference_training([o for o in config if not o.startswith("recompute.")])
        assert_matches_reference({"params": result, "losses": per_rank[0][index]["losses"]}, reference, atol=1e-6)
    stash = {name: stash_bytes_per_microbatch(per_rank[0][index]) for index, name in enumerate(runs)}
    for partial in ("gpt-1f1b", "gpt-1f1b-full-1"):   # selective; full on each stage's first layer
        assert_stash_grows({name: stash[name] for name in ("gpt-1f1b-full", partial, "gpt-1f1b-none")})
