"""cluster=measured: the planner plans with the sheet python -m planner.calibrate writes (issue's
first bullet: predictions on this machine come from what was measured on it, not from a device
sheet guessed on the spot). The sheet here is written by the test with known numbers, so the
prediction can be re-derived by hand; tests/distributed/test_planner_calibrate.py measures for real."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from omegaconf import OmegaConf

from planner.search.auto import make_plan
from planner.inputs.cluster_sheet import SCHEMA, model_fingerprint
from planner.config import compose, inputs_from_config
from planner.errors import PlannerError
from planner.inputs.hardware import cluster_from_config
from planner.inputs.model_specs import spec_from_config
from planner.inputs.profile import analytic_profile

LATENCY, BANDWIDTH = 2e-4, 1e9
AR_LATENCY, AR_BANDWIDTH = 3e-4, 5e8
OPT_PER_BYTE, OPT_OVERHEAD = 1e-9, 1e-3


def write_sheet(path, models=("model=gpt_tiny",)) -> dict:
    """A sheet with round numbers and a profile for each model (times from the A100 analytic model
    x 1000, so that they differ per layer)."""
    profiles = {}
    for over in models:
        cfg = compose([over])
        plain = OmegaConf.to_container(cfg.model, resolve=True)
        cluster = cluster_from_config(OmegaConf.to_container(compose(["cluster=dgx_a100"]).cluster))
        prof = analytic_profile(spec_from_config(plain, "fp32"), cluster.device, 1, (1, 2, 4, 8, 16))
        layers = tuple(replace(layer, forward_s=tuple(t * 1e3 for t in layer.forward_s),
                               backward_s=tuple(t * 1e3 for t in layer.backward_s)) for layer in prof.layers)
        prof = replace(prof, layers=layers, source="measured")
        profiles[model_fingerprint(plain)] = {"model": plain["preset"], "config": plain, "profile": prof.to_json()}
    sheet = {"schema": SCHEMA, "measured_at": "test", "host": "test", "threads": 1, "processes": 2,
             "device": {"flops_fp32": 5e10, "memory_bytes": 16 * 2**30, "memory_bandwidth": 1e10},
             "p2p": {"latency_s": LATENCY, "bandwidth": BANDWIDTH, "points": []},
             "allreduce": {"latency_s": AR_LATENCY, "bandwidth": AR_BANDWIDTH, "group": 2, "points": []},
             "optimizer": {"name": "adamw", "seconds_per_parameter_byte": OPT_PER_BYTE, "step_overhead_s": OPT_OVERHEAD},
             "compute_slowdown": 1.0, "process_base_bytes": 3e8, "machine_load": {}, "profiles": profiles}
    path.write_text(json.dumps(sheet))
    return sheet


def plan_for(path, *over):
    inputs = inputs_from_config(compose(["cluster=measured", f"cluster.calibration={path}",
                                         "train.global_batch_size=32", *over]))
    return inputs, make_plan(inputs, "ptdp", "strict", False).plan


def test_predictions_use_the_measured_sheet(tmp_path):
    path = tmp_path / "sheet.json"
    write_sheet(path)
    inputs, plan = plan_for(path, "train.micro_batch_size=4", "planner.pp=2", "planner.dp=1",
                            "planner.schedules=[1f1b]", "planner.recompute=[false]")
    assert inputs.profile.source == "measured" and inputs.cluster.device.name == "measured"
    # by hand: 1F1B takes (m + p - 1) slots of the slower stage; per micro-batch each rank posts two
    # messages and sends one boundary tensor (stage 0 the activation, stage 1 its gradient)
    fwd, bwd = inputs.profile.times(4)
    stage = [float((fwd + bwd)[0:3].sum()), float((fwd + bwd)[3:6].sum())]
    out_bytes = inputs.profile.arrays["output_bytes"][2] * 4
    slot = max(stage) + 2 * LATENCY + out_bytes / BANDWIDTH
    weights = inputs.profile.arrays["parameter_bytes"]
    update = OPT_OVERHEAD + OPT_PER_BYTE * max(weights[0:3].sum(), weights[3:6].sum())
    assert plan.predicted.iteration_time_s == pytest.approx((8 + 2 - 1) * slot + update, rel=1e-9)


def test_data_parallel_sync_uses_the_measured_allreduce(tmp_path):
    path = tmp_path / "sheet.json"
    write_sheet(path)
    inputs, plan = plan_for(path, "train.micro_batch_size=16", "planner.pp=1", "planner.dp=2",
                            "planner.schedules=[1f1b]", "planner.recompute=[false]",
                            "planner.overlap_grad_reduce=false", "planner.distributed_optimizer=false")
    fwd, bwd = inputs.profile.times(16)
    weights = float(inputs.profile.arrays["parameter_bytes"].sum())
    sync = 2 * AR_LATENCY + weights / AR_BANDWIDTH  # ring of 2: 2 (n-1) steps, 2 (n-1)/n of the bytes
    expected = float((fwd + bwd).sum()) + sync + OPT_OVERHEAD + OPT_PER_BYTE * weights
    assert plan.predicted.iteration_time_s == pytest.approx(expected, rel=1e-9)


def test_overlapped_reduction_and_the_distributed_optimizer_are_priced(tmp_path):
    """Overlapped: n = ceil(weights / bucket) buckets over the last micro-batch's backward B; a rank
    waits for max(R/n, R - B (1 - 1/n)) of the all-reduce R. Distributed optimizer: each rank updates
    half the parameters; its reduce-scatter (R/2) overlaps the backward the same way, or runs whole
    at the flush, and the all-gather of the parameters (R/2) overlaps the next forward F alike
    (max(R/2n, R/2 - F (1 - 1/n))), or runs whole after the update."""
    path = tmp_path / "sheet.json"
    write_sheet(path)
    pins = ("train.micro_batch_size=16", "planner.pp=1", "planner.dp=2", "planner.schedules=[1f1b]",
            "planner.recompute=[false]", "planner.grad_bucket_mb=0.01")
    inputs, overlapped = plan_for(path, *pins, "planner.overlap_grad_reduce=true", "planner.distributed_optimizer=false")
    # without overlap to lose, the sharded update (half the parameters) is the faster of the two
    _, sharded = plan_for(path, *pins, "planner.overlap_grad_reduce=false", "planner.distributed_optimizer=true")
    fwd, bwd = inputs.profile.times(16)
    weights = float(inputs.profile.arrays["parameter_bytes"].sum())
    sync = 2 * AR_LATENCY + weights / AR_BANDWIDTH
    n = math.ceil(weights / (0.01 * 2**20))
    backward, forward = float(bwd.sum()), float(fwd.sum())

    def exposed(reduction: float, hiding: float = backward) -> float:
        return max(reduction / n, reduction - hiding * (1 - 1 / n))

    compute = float((fwd + bwd).sum())
    assert overlapped.predicted.iteration_time_s == pytest.approx(
        compute + exposed(sync) + OPT_OVERHEAD + OPT_PER_BYTE * weights, rel=1e-9)
    assert sharded.distributed_optimizer and not overlapped.distributed_optimizer
    assert sharded.predicted.iteration_time_s == pytest.approx(compute + sync + OPT_OVERHEAD + OPT_PER_BYTE * weights / 2,
                                                               rel=1e-9)
    # both: the search may prefer the plain optimizer (what the sharded one saves in the update
    # may not pay for what its gather leaves exposed); its price, directly
    from planner.costs.uniform import estimate, rank_stats
    from planner.inputs.memory_options import MemoryOptions
    stats = rank_stats(inputs.profile, inputs.cluster, 1, 1, 1, 2, False, np.array([16.0]),
                       options=MemoryOptions(optimizer_shards=2, grad_bucket_bytes=0.01 * 2**20))
    priced = estimate(stats, inputs.cluster, "1f1b", 2, inputs.global_batch, inputs.workspace, inputs.runtime)
    assert priced.iteration_time[0] == pytest.approx(
        compute + exposed(sync / 2) + exposed(sync / 2, forward) + OPT_OVERHEAD + OPT_PER_BYTE * weights / 2,
        rel=1e-9)
    assert exposed(sync / 2, forward) < sync / 2   # the forward hides part of the gather here


def test_another_model_configuration_is_not_mistaken_for_the_calibrated_one(tmp_path):
    path = tmp_path / "sheet.json"
    write_sheet(path)
    inputs, _ = plan_for(path, "model.hidden_size=256", "model.num_heads=8")
    assert inputs.profile.source == "analytic"  # no profile of this configuration: the spec over the measured sheet


def test_a_missing_or_foreign_sheet_is_one_line(tmp_path):
    with pytest.raises(PlannerError, match="does not exist: measure this machine first with python -m planner.calibrate"):
        plan_for(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text(json.dumps({"schema": "x"}))
    with pytest.raises(PlannerError, match="has schema 'x', expected 'pipedream-cluster-sheet/1'"):
        plan_for(tmp_path / "bad.json")
    sheet = write_sheet(tmp_path / "inf.json")   # an older calibration's degenerate fit
    sheet["p2p"]["bandwidth"] = math.inf
    (tmp_path / "inf.json").write_text(json.dumps(sheet))
    with pytest.raises(PlannerError, match=r"p2p.bandwidth is inf, not a positive finite rate .*rerun python -m planner.calibrate"):
        plan_for(tmp_path / "inf.json")
