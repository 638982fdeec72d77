"""The runtime's own costs on a measured sheet (planner.inputs.runtime_costs, planner.calibrate.runtime):
per FWD/BWD action, per message, per step and the process's resident set, each where it occurs in
the prediction; tensor-parallel layers planned from their measured profile. The sheets carry known
numbers so each prediction is re-derived by hand here."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from planner.calibrate.runtime import overheads
from tests.unit.planner.calibrate.test_calibration import (LATENCY, BANDWIDTH, OPT_OVERHEAD, OPT_PER_BYTE, plan_for,
                                                          write_sheet)

ACTION, MESSAGE, STEP, PROCESS = 1e-3, 3e-4, 5e-3, 1e8
RATIO = 1.25   # the traced runs' layers / the profile's
RUNTIME = {"flush": {"compute_action_s": ACTION, "message_s": MESSAGE, "step_s": STEP, "layer_time_ratio": RATIO},
           "2bw": {"compute_action_s": 2 * ACTION, "message_s": 2 * MESSAGE, "step_s": 2 * STEP,
                   "layer_time_ratio": 2 * RATIO},
           "process_bytes": PROCESS}
FLUSH_1F1B = ("train.micro_batch_size=4", "planner.pp=2", "planner.dp=1", "planner.schedules=[1f1b]",
              "planner.recompute=[false]")


def with_runtime(path, runtime=RUNTIME, tp_profile=None) -> None:
    sheet = write_sheet(path)
    entry = next(iter(sheet["profiles"].values()))
    entry["runtime"] = runtime
    if tp_profile is not None:
        entry["profiles_tp"] = {"2": tp_profile}
    path.write_text(json.dumps(sheet))


def test_flush_prediction_adds_actions_messages_and_the_step(tmp_path):
    plain, runtime = tmp_path / "plain.json", tmp_path / "runtime.json"
    write_sheet(plain)
    with_runtime(runtime)
    inputs, before = plan_for(plain, *FLUSH_1F1B)
    _, after = plan_for(runtime, *FLUSH_1F1B)
    fwd, bwd = inputs.profile.times(4)
    stage = max(float((fwd + bwd)[0:3].sum()), float((fwd + bwd)[3:6].sum()))
    out_bytes = inputs.profile.arrays["output_bytes"][2] * 4
    # each rank: its layers at the traced pace, a FWD and a BWD, two messages (an activation out and its
    # gradient in, or the reverse) at their traced cost, which holds the transfer: no fitted latency on top
    slot = stage * RATIO + out_bytes / BANDWIDTH + 2 * ACTION + 2 * MESSAGE
    assert before.predicted.iteration_time_s == pytest.approx(
        (8 + 2 - 1) * (stage + 2 * LATENCY + out_bytes / BANDWIDTH) + OPT_OVERHEAD
        + OPT_PER_BYTE * max(inputs.profile.arrays["parameter_bytes"][0:3].sum(),
                             inputs.profile.arrays["parameter_bytes"][3:6].sum()), rel=1e-9)
    weights = inputs.profile.arrays["parameter_bytes"]
    update = OPT_OVERHEAD + OPT_PER_BYTE * max(weights[0:3].sum(), weights[3:6].sum())
    assert after.predicted.iteration_time_s == pytest.approx((8 + 2 - 1) * slot + update + STEP, rel=1e-9)
    # the process: the sheet's base (3e8) and what the traced runs held beyond the model
    grown = after.predicted.memory_bytes_per_device - before.predicted.memory_bytes_per_device
    assert grown == pytest.approx(3e8 + PROCESS)


def test_two_bw_uses_its_own_costs(tmp_path):
    path = tmp_path / "runtime.json"
    with_runtime(path)
    over = ("train.micro_batch_size=4", "planner.pp=2", "planner.dp=1", "planner.recompute=[false]")
    flush = plan_for(path, *over, "planner.schedules=[1f1b]")[1].predicted.iteration_time_s
    inputs = plan_for(path, *over, "planner.algorithm=2bw")[0]
    from planner.search.two_bw import two_bw_search

    two_bw = two_bw_search(inputs).best
    fwd, bwd = inputs.profile.times(4)
    stage = max(float((fwd + bwd)[0:3].sum()), float((fwd + bwd)[3:6].sum()))
    out_bytes = inputs.profile.arrays["output_bytes"][2] * 4
    # one pace for every family's layers: the least of the traced runs' ratios (flush's here)
    slot = stage * RATIO + out_bytes / BANDWIDTH + 2 * (2 * ACTION) + 2 * (2 * MESSAGE)
    weights = inputs.profile.arrays["parameter_bytes"]
    update = OPT_OVERHEAD + OPT_PER_BYTE * max(weights[0:3].sum(), weights[3:6].sum())
    assert two_bw.iteration_time == pytest.approx(8 * slot + update + 2 * STEP, rel=1e-9)
    assert two_bw.iteration_time != pytest.approx(flush)


def test_tensor_parallel_plans_from_its_measured_profile(tmp_path):
    plain = tmp_path / "plain.json"
    sheet = write_sheet(plain)
    base = next(iter(sheet["profiles"].values()))["profile"]
    tp = json.loads(json.dumps(base))
    tp["tensor_parallel"] = 2
    for layer in tp["layers"]:  # measured at t = 2: the all-reduces are inside these times
        layer["forward_s"] = [t * 0.7 for t in layer["forward_s"]]
        layer["backward_s"] = [t * 0.6 for t in layer["backward_s"]]
        layer["parameter_bytes"] /= 2
    path = tmp_path / "tp.json"
    with_runtime(path, {"flush": {"compute_action_s": 0.0, "message_s": 0.0, "step_s": 0.0}}, tp)
    assert plan_for(plain, "train.micro_batch_size=8")[0].tp_degrees() == [1]  # no measurement: no t > 1
    inputs, plan = plan_for(path, "train.micro_batch_size=8", "planner.tp=2", "planner.pp=1", "planner.dp=1",
                            "planner.schedules=[1f1b]", "planner.recompute=[false]")
    assert inputs.tp_degrees() == [2] and plan.parallel.tp == 2
    profile = inputs.profile_at(2)
    assert profile.tensor_parallel == 2 and profile.source == "measured"
    fwd, bwd = profile.times(8)
    update = OPT_OVERHEAD + OPT_PER_BYTE * float(profile.arrays["parameter_bytes"].sum())
    assert plan.predicted.iteration_time_s == pytest.approx(4 * float((fwd + bwd).sum()) + update, rel=1e-9)


def _event(name, cat, ts_ms, dur_ms, rank=0, step=5):
    return {"name": name, "cat": cat, "ph": "X", "pid": rank, "tid": 0, "ts": ts_ms * 1e3, "dur": dur_ms * 1e3,
            "args": {"step": step}}


def test_overheads_from_a_trace():
    """One rank, one iteration of two micro-batches whose layers the profile puts at 10 ms (F + B):
    4 ms before the first action and 11 ms after the last, one 2 ms wait, four 0.5 ms messages."""
    events = [_event("iteration 5", "iteration", 0, 60),
              _event("F0", "forward", 4, 4), _event("send", "send", 8, 0.5),
              _event("F1", "forward", 9, 4), _event("send", "send", 13, 0.5),
              _event("wait B0", "wait", 14, 2), _event("B0", "backward", 16, 7), _event("recv", "recv", 23, 0.5),
              _event("B1", "backward", 24, 7), _event("W1", "backward", 31, 1), _event("recv", "recv", 48.5, 0.5)]
    got = overheads({"traceEvents": events}, [0.010], [0.004])
    span, waits, messages, computing = 49 - 4, 2, 4 * 0.5, 4 + 4 + 7 + 7 + 1
    # the gaps between actions only (0.5 + 0.5 + 0.5 + 16.5 ms), whatever the layers took inside them
    assert got["compute_action_s"] == pytest.approx((span - waits - messages - computing) * 1e-3 / 4)
    assert got["compute_action_s"] == pytest.approx(18e-3 / 4)
    assert got["layer_time_ratio"] == pytest.approx(23 / 20)
    # layers profiled faster (a slowdown of the traced run's compute) do not turn into a per-action cost
    slower = overheads({"traceEvents": events}, [0.008], [0.004])
    assert slower["compute_action_s"] == pytest.approx(got["compute_action_s"])
    assert slower["layer_time_ratio"] == pytest.approx(23 / 16)
    assert got["message_s"] == pytest.approx(0.5e-3)
    assert got["step_s"] == pytest.approx((4 + 11) * 1e-3 - 0.004)


def test_layer_pace_is_the_least_disturbed_runs():
    from planner.inputs.runtime_costs import layer_pace, runtime_costs

    assert layer_pace([1.3, 2.1, 1.1]) == pytest.approx(1.1)
    assert layer_pace([]) == 1.0
    costs = runtime_costs({"runtime": RUNTIME})
    assert costs.for_schedule("2bw").layer_time_ratio == pytest.approx(RATIO)
    assert costs.for_schedule("1f1b").layer_time_ratio == pytest.approx(RATIO)
