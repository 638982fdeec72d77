"""harmony_pp's own costs: read from a traced run (``planner.calibrate.harmony``), stored in and read
back from a calibration sheet (``planner.harmony.costs``), and chosen by device count for the
estimator (``planner.harmony.plan.harmony_overheads``). Numbers worked out by hand."""
from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import pytest

from planner.calibrate.harmony import harmony_overheads as from_trace
from planner.harmony.costs import harmony_costs
from planner.harmony.estimator import HarmonyOverheads
from planner.harmony.plan import harmony_overheads
from planner.harmony.tasks import ProfileCosts
from planner.inputs.profile import LayerProfile, Profile
from pipedream.schedules.harmony import harmony_config


def toy_profile() -> Profile:
    # per layer at 2 samples: forward 2 ms, backward 4 ms; 100 bytes of weights
    layers = tuple(LayerProfile(f"l{i}", "block", (1e-3, 2e-3), (2e-3, 4e-3), 1.0, 100.0, 0.0, 2.0, 1.0)
                   for i in range(2))
    return Profile("toy", "dev", "measured", "fp32", 1, (1, 2), layers)


def event(name, cat, ts, dur, microbatch=None, chunk=None):
    args = {"step": 4} if microbatch is None else {"step": 4, "microbatch": microbatch, "chunk": chunk}
    return {"name": name, "cat": cat, "ph": "X", "pid": 0, "tid": 0, "ts": ts, "dur": dur, "args": args}


def test_costs_from_a_trace_by_hand():
    # one process, 2 layers: task 0 forward [0,1), task 1 the jit pack [1,2), task 2 backward [0,1)
    costs = ProfileCosts(toy_profile(), harmony_config(2, 4, 1), 2)
    assert (costs.forward_s(0), costs.forward_s(1), costs.backward_s(1), costs.backward_s(2)) == \
        pytest.approx((2e-3, 2e-3, 4e-3, 6e-3))   # the backward task recomputes: 4 + 2 ms
    assert costs.stash_bytes(2) == 0.0             # layer 0's input is the data
    trace = {"traceEvents": [
        event("iteration 4", "iteration", 0, 30000),
        event("SI", "swap", 1000, 300),               # 100 B at 1 MB/s is 100 us: 200 us beyond
        event("F0", "forward", 1300, 4000, 0, 0),    # 4 ms where the profile says 2
        event("SO0.2", "swap", 5300, 150, 0, 2),      # a stash of 0 bytes: 150 us
        event("wait F0.1", "wait", 5450, 550, 0, 1),
        event("F0.1", "forward", 6000, 3000, 0, 1),
        event("B0.1", "backward", 9000, 6000, 0, 1),
        event("U.1", "update", 15000, 500),           # the fit: 1 us/B x 100 B = 100 us: 400 us beyond
        event("B0.2", "backward", 15600, 9000, 0, 2),  # 100 us after U.1 ends
        event("SA0", "send", 24600, 80, 0, 0),
    ]}
    got = from_trace(trace, toy_profile(), 1, swap_bandwidth=1e6, update_per_byte=1e-6)
    assert got["swap_s"] == pytest.approx(200e-6)
    assert got["stash_s"] == pytest.approx(150e-6)
    assert got["update_s"] == pytest.approx(400e-6)
    assert got["message_s"] == pytest.approx(80e-6)
    assert got["forward_ratio"] == pytest.approx(2.0)
    # with a graph: (3 + 6 + 9 ms) over the profile's (2 + 4 + 6 ms)
    assert got["train_ratio"] == pytest.approx(1.5)
    # first action at 1000 us, last ends at 24680: 23680 us, of which actions and waits 23580; 100 us
    # between the 8 actions
    assert got["action_s"] == got["compute_action_s"] == pytest.approx(100e-6 / 8)
    # before the first action 1000 us, after the last 30000 - 24680 = 5320 us
    assert got["step_s"] == pytest.approx(6320e-6)


def test_costs_round_trip_through_the_sheet_and_by_device_count():
    from planner.harmony.plan import harmony_overheads as chosen
    from planner.inputs.hardware import Cluster, Level
    from planner.inputs.search_inputs import Inputs
    from pipedream.devices import DEVICES

    one = {"action_s": 1e-5, "swap_s": 2e-4, "stash_s": 3e-4, "update_s": 4e-4, "step_s": 5e-4,
           "forward_ratio": 1.0, "train_ratio": 1.25}
    two = {**one, "message_s": 6e-5, "train_ratio": 1.5}
    entry = {"runtime": {"flush": {}, "harmony": {"1": one, "2": two, "errors": {"4": "refused"}}}}
    costs = harmony_costs(entry)
    assert sorted(costs) == [1, 2]
    assert costs[1] == HarmonyOverheads(step_s=5e-4, action_s=1e-5, swap_s=2e-4, stash_s=3e-4, update_s=4e-4,
                                        train_ratio=1.25)
    assert costs[2].message_s == 6e-5 and costs[2].train_ratio == 1.5
    assert harmony_costs(None) == {} and harmony_costs({"runtime": {"flush": {}}}) == {}
    cluster = Cluster("m", DEVICES["h200"], (Level("p2p", 2, 1e9),), 2, "cpu", MappingProxyType({}))
    inputs = replace(Inputs("m", toy_profile(), cluster, 8), harmony_costs=costs)
    # one device: the 1-process costs; 2 and 4 devices (processes sharing the cores): the 2-process ones
    assert chosen(inputs, 1) == costs[1]
    assert chosen(inputs, 2) == chosen(inputs, 4) == costs[2]
    # without harmony runs in the sheet (and without flush ones): nothing
    assert harmony_overheads(Inputs("m", toy_profile(), cluster, 8), 2) == HarmonyOverheads()


def test_costs_traced_with_more_processes_than_slots_leave_the_waiting_to_the_slots():
    """4 processes on 2 cores: each traced layer also waited for its core, which the estimator's 2
    compute slots queue again; the ratios keep the slots' share (2 of 4), the rest is unchanged."""
    from planner.inputs.hardware import Cluster, Level
    from planner.inputs.search_inputs import Inputs
    from pipedream.devices import DEVICES

    two = HarmonyOverheads(swap_s=1e-4, forward_ratio=1.2, train_ratio=1.3)
    four = HarmonyOverheads(swap_s=2e-4, forward_ratio=2.0, train_ratio=2.4)
    sheet = {"cores": 2, "processes": 4, "matmul_slowdown_all_busy": 2.0}
    cluster = Cluster("m", DEVICES["h200"], (Level("p2p", 4, 1e9),), 4, "cpu", MappingProxyType({"sheet": sheet}))
    inputs = replace(Inputs("m", toy_profile(), cluster, 8), harmony_costs=MappingProxyType({2: two, 4: four}))
    assert harmony_overheads(inputs, 2) == two
    assert harmony_overheads(inputs, 4) == replace(four, forward_ratio=1.0, train_ratio=1.2)
    gpu = replace(cluster, runtime_device="cuda")
    assert harmony_overheads(replace(inputs, cluster=gpu), 4) == four   # devices of their own: nothing shared
