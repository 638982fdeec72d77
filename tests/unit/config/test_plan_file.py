"""The plan file contract (docs/planner.md): round trip, validation, world size; one line per error."""
from __future__ import annotations

import json

import pytest

from pipedream.config.plan_file import PlanError, load_plan, plan_from_json


def plan_dict(**over):
    data = {
        "version": 1,
        "model": {"name": "gpt_tiny", "num_layers": 6, "num_parameters": 834304},
        "cluster": {"name": "local_cpu", "num_devices": 4, "devices_per_node": 4},
        "parallel": {"pp": 2, "tp": 1, "dp": 2, "vpp": 1},
        "schedule": "1f1b",
        "batch": {"global": 16, "micro": 2, "num_microbatches": 4},
        "recompute": "none",
        "stages": [{"layers": [0, 3], "replicas": 2, "ranks": [0, 1]},
                   {"layers": [3, 6], "replicas": 2, "ranks": [2, 3]}],
        "predicted": {"iteration_time_s": 1.0, "samples_per_s": 16.0, "tflops_per_device": 0.1,
                      "bubble_fraction": 0.25, "memory_bytes_per_device": 1e6},
        "alternatives": [],
    }
    data.update(over)
    return data


def test_round_trip(tmp_path):
    plan = plan_from_json(plan_dict())
    assert plan.world_size == 4
    path = tmp_path / "plan.json"
    plan.save(path)
    again = load_plan(path)
    assert again == plan
    assert json.loads(path.read_text())["batch"]["global"] == 16
    plan.check_world_size(4)


def test_world_size_mismatch_is_one_line():
    plan = plan_from_json(plan_dict())
    with pytest.raises(PlanError) as err:
        plan.check_world_size(3)
    assert "\n" not in str(err.value)
    assert "needs 4 processes" in str(err.value) and "WORLD_SIZE = 3" in str(err.value)


def test_uneven_replication_only_for_pipedream():
    stages = [{"layers": [0, 3], "replicas": 3, "ranks": [0, 1, 2]}, {"layers": [3, 6], "replicas": 1, "ranks": [3]}]
    data = plan_dict(stages=stages, schedule="pipedream", parallel={"pp": 2, "tp": 1, "dp": 3, "vpp": 1},
                     batch={"global": 12, "micro": 2, "num_microbatches": 2})
    assert plan_from_json(data).world_size == 4
    data["schedule"] = "1f1b"
    with pytest.raises(PlanError, match="only the pipedream schedule"):
        plan_from_json(data)


def test_interleaved_stages_share_ranks():
    stages = [{"layers": [0, 2], "replicas": 1, "ranks": [0]}, {"layers": [2, 3], "replicas": 1, "ranks": [1]},
              {"layers": [3, 5], "replicas": 1, "ranks": [0]}, {"layers": [5, 6], "replicas": 1, "ranks": [1]}]
    data = plan_dict(stages=stages, schedule="interleaved", parallel={"pp": 2, "tp": 1, "dp": 1, "vpp": 2},
                     batch={"global": 8, "micro": 2, "num_microbatches": 4})
    assert plan_from_json(data).world_size == 2
    stages[2]["ranks"] = [1]
    with pytest.raises(PlanError, match="same ranks"):
        plan_from_json(data)


@pytest.mark.parametrize("change, message", [
    ({"version": 2}, "version"),
    ({"schedule": "zigzag"}, "schedule"),
    ({"recompute": "some"}, "recompute"),
    ({"parallel": {"pp": 0, "tp": 1, "dp": 2}}, "parallel.pp"),
    ({"batch": {"global": 15, "micro": 2, "num_microbatches": 4}}, "batch.global"),
    ({"stages": [{"layers": [0, 3], "replicas": 2}, {"layers": [4, 6], "replicas": 2}]}, "must start at 3"),
    ({"stages": [{"layers": [0, 3], "replicas": 2}, {"layers": [3, 5], "replicas": 2}]}, "cover layers"),
    ({"stages": [{"layers": [0, 6], "replicas": 2}]}, "pp\\*vpp"),
    ({"model": {"name": "x"}}, "model.num_layers"),
])
def test_bad_plans(change, message):
    with pytest.raises(PlanError, match=message) as err:
        plan_from_json(plan_dict(**change))
    assert "\n" not in str(err.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(PlanError, match="cannot read"):
        load_plan(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not JSON"):
        load_plan(bad)


def cp_plan_dict(**over):
    """pp 2 x dp 2 x cp 2: each stage's replicas span cp ranks each (tp, cp, dp, pp fastest first)."""
    stages = [{"layers": [0, 3], "replicas": 2, "ranks": [0, 1, 2, 3]},
              {"layers": [3, 6], "replicas": 2, "ranks": [4, 5, 6, 7]}]
    return plan_dict(**{"stages": stages, "cluster": {"name": "local_cpu", "num_devices": 8, "devices_per_node": 8},
                        "context_parallel": 2, **over})


@pytest.mark.parametrize("zero, level, distributed", [(3, 3, "zero3"), ("zero2", 2, "zero2"), (0, 0, False),
                                                      ("zero1", 1, True), ("false", 0, False)])
def test_context_parallel_and_zero_round_trip(tmp_path, zero, level, distributed):
    plan = plan_from_json(cp_plan_dict(zero=zero, distributed_optimizer=level >= 1))
    assert (plan.context_parallel, plan.zero, plan.optim_distributed) == (2, level, distributed)
    assert plan.world_size == 8 and plan.distributed_optimizer == (level >= 1)
    plan.save(tmp_path / "plan.json")
    again = load_plan(tmp_path / "plan.json")
    assert again == plan
    written = json.loads((tmp_path / "plan.json").read_text())
    assert (written["context_parallel"], written["zero"]) == (2, level)
    with pytest.raises(PlanError, match=r"pp\*tp\*dp\*cp = 2\*1\*2\*2"):
        plan.check_world_size(4)


def test_reshard_after_forward_round_trips_with_zero3(tmp_path):
    plan = plan_from_json(cp_plan_dict(zero=3, distributed_optimizer=True, reshard_after_forward=True))
    assert plan.reshard_after_forward and plan.optim_distributed == "zero3"
    plan.save(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json") == plan
    assert json.loads((tmp_path / "plan.json").read_text())["reshard_after_forward"] is True


def test_older_plans_without_cp_or_zero_still_load():
    assert (plan_from_json(plan_dict()).context_parallel, plan_from_json(plan_dict()).zero) == (1, 0)
    assert plan_from_json(plan_dict()).reshard_after_forward is False
    old = plan_from_json(plan_dict(distributed_optimizer=True))   # ZeRO-1 before the level existed
    assert (old.zero, old.optim_distributed) == (1, True)


@pytest.mark.parametrize("change, message", [
    ({"zero": 4}, "plan zero = 4 must be 0, 1, 2 or 3"),
    ({"zero": "zero9"}, "plan zero = 'zero9'"),
    ({"zero": 2, "distributed_optimizer": False}, "distributed_optimizer must be true exactly for ZeRO levels 1 to 3"),
    ({"context_parallel": 0}, "plan context_parallel = 0 must be an integer >= 1"),
    ({"zero": 1, "distributed_optimizer": True, "reshard_after_forward": True},
     "plan reshard_after_forward = true needs zero = 3"),
    ({"reshard_after_forward": "yes"}, "plan reshard_after_forward = 'yes' must be true or false"),
])
def test_bad_cp_and_zero_are_one_line(change, message):
    with pytest.raises(PlanError, match=message) as err:
        plan_from_json(cp_plan_dict(**change))
    assert "\n" not in str(err.value)


def test_cp_ranks_are_listed_per_stage():
    data = cp_plan_dict()
    data["stages"][0]["ranks"] = [0, 1]
    with pytest.raises(PlanError, match="lists 2 ranks for 2 replicas x tp 1 x cp 2"):
        plan_from_json(data)
