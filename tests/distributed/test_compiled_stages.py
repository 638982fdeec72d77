"""train.compile: each layer runs through torch.compile and training still equals single-process
eager training: exactly with the aot_eager backend (the same kernels through AOTAutograd), within
COMPILED_ATOL with inductor's generated kernels (fused, reordered reductions)."""
from __future__ import annotations

import pytest

from tests.support.workers import run_workers
from tests.support.training_harness import TINY_GPT, assert_matches_reference, merge_params, reference_training, train_rank

SGD = ["optim=sgd", "train.lr=0.05", "train.steps=3", "parallel.pp=2", "schedule=1f1b", "model.tie_embeddings=false"]
SMALL_GPT = [o for o in TINY_GPT if not o.startswith("model.num_layers")] + ["model.num_layers=2"]
MLP = ["model=mlp", "data=synthetic", "model.num_layers=4", "model.hidden_size=16", "train.global_batch_size=16",
       "train.micro_batch_size=2", "train.eval_every=0", "train.log_every=1", "train.progress=false", "optim=sgd",
       "train.lr=0.05", "train.steps=3", "parallel.pp=2"]
COMPILED_ATOL = 1e-5   # inductor's kernels against eager, fp32 (docs/design.md, Compiled stages)


@pytest.mark.slow
def test_compiled_layers_train_as_eager_ones(tmp_path):
    runs = {"gpt-aot_eager": (SMALL_GPT + SGD + ["train.compile=aot_eager"], 1e-6),
            "gpt-inductor": (SMALL_GPT + SGD + ["train.compile=true"], COMPILED_ATOL),
            "mlp-inductor": (MLP + ["train.compile=true"], COMPILED_ATOL)}
    per_rank = run_workers(train_rank, 2, [(config, str(tmp_path / name)) for name, (config, _) in runs.items()],
                           timeout=900)
    for index, (config, atol) in enumerate(runs.values()):
        result = merge_params([rank_results[index] for rank_results in per_rank])
        reference = reference_training([o for o in config if not o.startswith("train.compile")])
        assert_matches_reference({"params": result, "losses": per_rank[0][index]["losses"]}, reference, atol=atol)
