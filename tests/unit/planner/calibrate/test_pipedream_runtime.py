"""PipeDream on a measured machine: a replicated stage pays the calibrated gradient all-reduce after
each backward (the runtime's SYNC is blocking, not overlapped), and every update pays the traced
runs' per-update cost beyond the optimizer fit. The sheets carry round numbers so each prediction
is re-derived by hand here."""
from __future__ import annotations

import json

import pytest

from planner.calibrate.runtime import overheads
from planner.search.pipedream_dp import DPStage, MemoryModel, pipedream_dp, replica_stage_time
from planner.search.pipedream_search import _candidate, data_parallel_time, dp_options
from tests.unit.planner.calibrate.test_calibration import AR_BANDWIDTH, AR_LATENCY, OPT_OVERHEAD, OPT_PER_BYTE, plan_for
from tests.unit.planner.costs.test_runtime_costs import _event, with_runtime

ACTION, MESSAGE, STEP, UPDATE, RATIO = 1e-4, 2e-4, 3e-3, 5e-4, 1.5
RUNTIME = {"flush": {"compute_action_s": 0.0, "message_s": 0.0, "step_s": 0.0, "layer_time_ratio": 2 * RATIO},
           "pipedream": {"compute_action_s": ACTION, "message_s": MESSAGE, "step_s": STEP, "update_s": UPDATE,
                         "layer_time_ratio": RATIO},
           "process_bytes": 0.0}


def _inputs(tmp_path, runtime=RUNTIME):
    path = tmp_path / "sheet.json"
    with_runtime(path, runtime)
    return plan_for(path, "train.micro_batch_size=4", "planner.algorithm=pipedream", "planner.recompute=[false]",
                    "planner.memory_constraint=false")[0]


def test_replica_stage_time_adds_the_sync_to_compute():
    # 10 ms of layers and a 2 ms all-reduce on 2 replicas: 6 ms per input (the paper's max() would say 5)
    assert replica_stage_time(0.010, 0.002, 2) == pytest.approx(0.006)
    assert replica_stage_time(0.010, 0.0, 1) == pytest.approx(0.010)


def test_a_replicated_stage_pays_the_measured_allreduce(tmp_path):
    inputs = _inputs(tmp_path)
    fwd, bwd = inputs.profile.times(4)
    compute = float((fwd + bwd).sum()) * RATIO  # the layers at the least disturbed traced run's pace
    weights = float(inputs.profile.arrays["parameter_bytes"].sum())
    sync = 2 * AR_LATENCY + weights / AR_BANDWIDTH  # ring of 2: 2 (n-1) steps, 2 (n-1)/n of the bytes
    assert data_parallel_time(inputs, 4, False) == pytest.approx((compute + sync) / 2, rel=1e-12)
    # the DP charges its whole-model candidate on both devices the same (here it wins)
    result = pipedream_dp(inputs.profile, inputs.cluster, 4, dp_options(inputs), MemoryModel(None))
    assert result.stages == (DPStage(0, inputs.profile.num_layers, (0, 1)),)
    assert result.time_per_input == pytest.approx((compute + sync) / 2, rel=1e-12)


def test_a_slow_allreduce_makes_the_dp_split_instead_of_replicate(tmp_path):
    """The paper's 2 (r-1) W / B_k over a measured sheet's p2p level (bandwidth often infinite on one
    machine) charged nothing: the all-reduce fit is what decides."""
    path = tmp_path / "sheet.json"
    with_runtime(path, RUNTIME)
    sheet = json.loads(path.read_text())
    sheet["allreduce"]["bandwidth"] = 1e5  # 3.5 MB of weights: 35 s, against 80-120 s per stage
    path.write_text(json.dumps(sheet))
    inputs = plan_for(path, "train.micro_batch_size=4")[0]
    result = pipedream_dp(inputs.profile, inputs.cluster, 4, dp_options(inputs), MemoryModel(None))
    assert all(st.replicas == 1 for st in result.stages) and len(result.stages) == 2


def test_every_update_pays_the_calibrated_update_cost(tmp_path):
    inputs = _inputs(tmp_path)
    n = inputs.profile.num_layers
    fwd, bwd = inputs.profile.times(4)
    weights = inputs.profile.arrays["parameter_bytes"]
    # one stage on both devices: 8 inputs per step, each replica updates after each of its 4
    replicated = _candidate(inputs, (DPStage(0, n, (0, 1)),), 4, False, 0.0, MemoryModel(None))
    update = (OPT_OVERHEAD + OPT_PER_BYTE * float(weights.sum()) + UPDATE) / 2
    actions = 2 * ACTION / 2  # a FWD and a BWD per input, no messages, over 2 replicas
    assert replicated.iteration_time == pytest.approx(8 * (update + actions) + STEP, rel=1e-12)
    # a straight pipeline: each stage updates after every input; the slower stage's update sets the pace
    straight = _candidate(inputs, (DPStage(0, 3, (0,)), DPStage(3, n, (1,))), 4, False, 0.0, MemoryModel(None))
    update = OPT_OVERHEAD + OPT_PER_BYTE * max(float(weights[0:3].sum()), float(weights[3:n].sum())) + UPDATE
    actions = 2 * ACTION + 2 * MESSAGE  # a FWD and a BWD, the boundary's two messages on each stage
    assert straight.iteration_time == pytest.approx(8 * (update + actions) + STEP, rel=1e-12)
    assert float((fwd + bwd).sum()) > 0  # the layers come on top (per_input), as the DP's time


def test_pipedream_updates_are_measured_per_update_not_per_action():
    """One rank, one iteration of two inputs (layers profiled at 10 ms F + B, optimizer fit 1 ms):
    the previous input's SYNC and STEP before the first action, F0 B0 SYNC STEP F1 B1 inside."""
    events = [_event("iteration 5", "iteration", 0, 40),
              _event("SYNC", "sync", 0.5, 0.5), _event("STEP", "step", 1, 2),
              _event("F0", "forward", 3.5, 4), _event("B0", "backward", 7.5, 7),
              _event("SYNC", "sync", 15, 0.5), _event("STEP", "step", 15.5, 2.5),
              _event("F1", "forward", 18.5, 4), _event("B1", "backward", 22.5, 7)]
    got = overheads({"traceEvents": events}, [0.010], [0.001], per_update=True)
    # each STEP less the fit: 2 - 1 and 2.5 - 1 ms; the median of the two
    assert got["update_s"] == pytest.approx(1.25e-3)
    # the gaps between actions without the updates: (29.5 - 3.5) - 22 (F, B) - 3 (SYNC, STEP) = 1 ms / 4
    assert got["compute_action_s"] == pytest.approx(1e-3 / 4)
    # outside the actions: 3.5 before and 10.5 after, less the first update's 2.5 ms
    assert got["step_s"] == pytest.approx((3.5 + 10.5 - 2.5) * 1e-3)
    assert got["layer_time_ratio"] == pytest.approx(22 / 20)
    # without per_update (the flush families) the updates between actions stay in the gaps
    flush = overheads({"traceEvents": events}, [0.010], [0.001])
    assert "update_s" not in flush
    assert flush["compute_action_s"] == pytest.approx(4e-3 / 4)
