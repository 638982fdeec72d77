"""planner.calibrate.harmony for real: traced harmony_pp runs on 1 and 2 processes give the
estimator harmony_pp's own costs; a model harmony_pp refuses is recorded, not fatal."""
from __future__ import annotations

import pytest

from planner.calibrate.harmony import measure_harmony
from planner.harmony.costs import alone_profile, harmony_costs
from planner.harmony.estimator import HarmonyOverheads, Links, estimate
from planner.harmony.tasks import ProfileCosts
from planner.calibrate.measure import measure_profile
from pipedream.config.loading import compose_config
from pipedream.schedules.harmony import harmony_config, harmony_pp

MODEL = ["model=gpt_tiny", "model.num_layers=2", "model.tie_embeddings=false"]
SHEET = {"device": {"swap_bandwidth": 1e10}, "matmul_slowdown_all_busy": 1.0,
         "optimizer": {"seconds_per_parameter_byte": 1e-10, "step_overhead_s": 0.0}}


def test_harmony_runs_give_the_estimator_its_costs():
    model = compose_config(MODEL).model
    profile = measure_profile(model, [2], "cpu", repeats=2)
    section = measure_harmony(MODEL, model, SHEET, micro_batches=[1, 2], launches=1)
    assert "errors" not in section, section
    # the layers timed alone around the runs, at the sheet's sizes: what the ratios are over
    alone = alone_profile({"runtime": {"harmony": section}})
    assert alone.num_layers == profile.num_layers and list(alone.micro_batch_sizes) == [1, 2]
    costs = harmony_costs({"runtime": {"harmony": section}})
    assert sorted(costs) == [1, 2]
    for measured in costs.values():
        assert measured.forward_ratio > 0 and measured.train_ratio > 0 and measured.step_s > 0
        assert measured.swap_s > 0 and measured.stash_s > 0   # allocation and copies beyond the bytes
    assert costs[1].message_s == 0 and costs[2].message_s > 0   # one process sends nothing
    # the same configuration costs more with the runtime's own costs than with none (ratios above
    # 1/2: the layers did not run twice as fast as they were profiled)
    config = harmony_config(profile.num_layers, 4, 2)
    lists, action_costs = harmony_pp(config), ProfileCosts(profile, config, 2)
    links = Links(1e10, 1e9, synchronous=True, compute_slots=2)
    half = HarmonyOverheads(forward_ratio=0.5, train_ratio=0.5)
    assert estimate(config, lists, action_costs, links, costs[2]).iteration_s > \
        estimate(config, lists, action_costs, links, half).iteration_s


def test_a_model_harmony_pp_refuses_is_recorded():
    model = ["model=resnet50_small", "data=synthetic_images"]   # BatchNorm: refused before launch
    section = measure_harmony(model, compose_config(model).model, SHEET)
    assert sorted(section) == ["errors"] and sorted(section["errors"]) == ["1", "2"]
    assert all("model=resnet50 is not supported" in reason for reason in section["errors"].values()), section


def test_harmony_pp_is_also_traced_at_the_sheets_own_process_count(monkeypatch):
    """More processes than cores time-slice, which only their own runs measure."""
    launched = []

    def refused(overrides, processes, run_dir):
        launched.append(processes)
        return {"error": "error: stopped here"}
    monkeypatch.setattr("planner.calibrate.harmony.traced_harmony_run", refused)
    monkeypatch.setattr("planner.calibrate.measure.measure_profile", lambda *args, **kwargs: None)
    section = measure_harmony(MODEL, compose_config(MODEL).model, {**SHEET, "processes": 4})
    assert launched == [1, 2, 4] and sorted(section["errors"]) == ["1", "2", "4"]


def test_each_cost_is_the_median_over_launches(monkeypatch):
    """A launch as a whole runs faster or slower than the next: every cost is taken over launches."""
    import itertools
    import random
    from dataclasses import replace

    from tests.support.planner_helpers import random_profile

    alone = replace(random_profile(random.Random(4), 3), source="measured")
    swaps = itertools.count(1)
    monkeypatch.setattr("planner.calibrate.harmony.traced_harmony_run", lambda *args: {"trace": {}})
    monkeypatch.setattr("planner.calibrate.measure.measure_profile", lambda *args, **kwargs: alone)
    monkeypatch.setattr("planner.calibrate.harmony.harmony_overheads",
                        lambda *args: {"swap_s": float(next(swaps)), "forward_ratio": 1.0, "train_ratio": 1.0})
    section = measure_harmony(MODEL, compose_config(MODEL).model, SHEET, launches=3)
    # two timings per launch (before and after) give costs 1,2 | 3,4 | 5,6: each launch keeps its first
    assert section["1"]["swap_s"] == 3.0 and section["2"]["swap_s"] == 9.0
    mean = alone_profile({"runtime": {"harmony": section}})   # the mean of identical timings
    assert [t for la in mean.layers for t in la.forward_s] == pytest.approx([t for la in alone.layers
                                                                            for t in la.forward_s])
