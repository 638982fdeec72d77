"""Plugin models train like the built-in ones: the example project's model (an ``nn.Sequential``
given to ``from_modules`` whose modules pass (hidden states, boolean padding mask) tuples on as one
argument, as plain PyTorch calls them; both tensors cross every stage boundary) matches single-process training
under 1F1B (with and without recomputation) and the interleaved schedule (fp32, the equality
tolerance of the other tests)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.training_harness import assert_matches_reference, merge_params, reference_training, train_rank
from tests.support.workers import run_workers

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "masked_sequences"
PLUGIN = ["model._target_=maskseq.model.build", "model.width=16", "data._target_=maskseq.data.build",
          "data.num_samples=256", "train.global_batch_size=8", "train.micro_batch_size=2", "train.steps=3",
          "train.warmup_steps=1", "train.eval_every=0", "train.eval_batches=1", "train.log_every=1",
          "train.progress=false", "train.timeout_s=60", "optim=sgd", "train.lr=0.05"]
LAYOUTS = {"1f1b": ["schedule=1f1b", "parallel.pp=2", "parallel.vpp=1"],
           "interleaved": ["schedule=interleaved", "parallel.pp=2", "parallel.vpp=2"],
           "1f1b-recompute": ["schedule=1f1b", "parallel.pp=2", "parallel.vpp=1", "recompute.granularity=full"]}


@pytest.mark.slow
def test_two_tensor_boundary_plugin_matches_single_process(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))   # spawned ranks inherit sys.path
    runs = [(PLUGIN + extra, str(tmp_path / name)) for name, extra in LAYOUTS.items()]
    per_rank = run_workers(train_rank, 2, runs)
    reference = reference_training(PLUGIN)
    for index, name in enumerate(LAYOUTS):
        result = merge_params([rank_results[index] for rank_results in per_rank])
        assert_matches_reference({"params": result, "losses": per_rank[0][index]["losses"]}, reference)
        boundary_bytes = per_rank[0][index]["summary"]["ranks"][0]["bytes_sent"]
        assert boundary_bytes > 0, name


@pytest.mark.slow
def test_a_parameter_shared_by_two_stages_matches_single_process(tmp_path):
    """``from_modules`` finds the Linear used as layer 0 and layer 3; on two stages its gradients
    are summed across them, as the single-process model accumulates both uses into one."""
    tied = ["model._target_=tests.support.plugin_cases.tied_across_layers", "data._target_=tests.support.plugin_cases.tied_data",
            "train.global_batch_size=8", "train.micro_batch_size=2", "train.steps=3", "train.warmup_steps=1",
            "train.eval_every=0", "train.log_every=1", "train.progress=false", "train.timeout_s=60", "optim=sgd",
            "train.lr=0.05", "parallel.pp=2"]
    per_rank = run_workers(train_rank, 2, [(tied, str(tmp_path / "tied"))])
    result = merge_params([rank_results[0] for rank_results in per_rank])
    assert {"0.module.weight", "3.module.weight"} <= set(result)
    assert_matches_reference({"params": result, "losses": per_rank[0][0]["losses"]}, reference_training(tied))
