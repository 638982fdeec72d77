"""A plan from ``planner.algorithm=harmony`` trains: ``parallel.plan=`` folds it into harmony_pp on
two processes, the losses and weights equal single-process training, every rank stays within the
planned budget (below the weights plus optimizer state), and the weight and gradient bytes the
estimator counted for the plan are what the runtime's counters moved."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from tests.support.harmony_plan_harness import planned_harmony_rank
from tests.support.training_harness import TINY_GPT, assert_matches_reference, merge_params, reference_training
from tests.support.workers import run_workers

MODEL = [o for o in TINY_GPT if o.startswith("model.") or o.startswith("model=")] + ["model.tie_embeddings=false"]
TRAIN = ["schedule=harmony_pp", "train.grad_clip=0", "train.steps=3", "trace.enabled=false", "optim=sgd",
         "train.lr=0.05"]


@pytest.mark.slow
def test_a_harmony_plan_trains_like_one_process(tmp_path):
    from planner.__main__ import main as planner_main

    reference = reference_training(TINY_GPT + TRAIN + ["model.tie_embeddings=false"])
    weights = sum(t.numel() * t.element_size() for t in reference["params"].values())
    # below the weights plus SGD's momentum (2|W|): the model could not sit on one device; the planner
    # counts activations and the prefetched next pack too, so it needs more room than the runtime's minimum
    budget = int(1.5 * weights)
    plan_path = tmp_path / "plan.json"
    with contextlib.redirect_stdout(io.StringIO()):
        assert planner_main(MODEL + ["cluster=local_cpu", "train.global_batch_size=8", "train.micro_batch_size=2",
                                     "planner.algorithm=harmony", f"planner.device_budget_bytes={budget}",
                                     f"planner.out={plan_path}"]) == 0
    plan = json.loads(plan_path.read_text())
    assert plan["schedule"] == "harmony_pp" and plan["harmony"]["devices"] == 2
    overrides = TINY_GPT + TRAIN + ["model.tie_embeddings=false", f"parallel.plan={plan_path}"]
    per_rank = run_workers(planned_harmony_rank, 2, overrides, str(tmp_path / "run"))
    merged = merge_params(per_rank)
    assert_matches_reference({"params": merged, "losses": per_rank[0]["losses"]}, reference, atol=1e-6)
    ranks = [r["memory"] for r in per_rank[0]["summary"]["ranks"]]
    assert all(m["device_budget_bytes"] == budget and 0 < m["peak_resident_bytes"] <= budget for m in ranks)
    moved = {(cls, d): sum(m["swap_bytes_last_step"][cls][d] for m in ranks)
             for cls in ("weights", "gradients") for d in ("host_to_device", "device_to_host")}
    planned = plan["planner"]["swap_bytes"]
    assert moved[("weights", "host_to_device")] == planned["weights_in"]
    assert moved[("gradients", "device_to_host")] == planned["gradients_out"]
