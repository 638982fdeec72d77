"""A planner plan file drives a run: its degrees, split, schedule and batch replace the config's."""
from __future__ import annotations

import json
import re

import pytest

from pipedream.errors import ConfigError
from pipedream.config.plan_config import apply_plan, check_plan_world_size
from pipedream.config.run_spec import build_run_spec
from models.facts import parameter_count
from tests.support.training_harness import compose_config


def default_model_parameters() -> int:
    return parameter_count(compose_config([]).model)


def write_plan(path, layers=((0, 2), (2, 6)), num_layers=6, schedule="gpipe", **extra):
    """A plan for the default config's model (gpt_tiny) and global batch (32)."""
    plan = {"version": 1, "model": {"name": "gpt_tiny", "num_layers": num_layers,
                                    "num_parameters": default_model_parameters()},
            "cluster": {"name": "local_cpu", "num_devices": 2, "devices_per_node": 2},
            "parallel": {"pp": len(layers), "tp": 1, "dp": 1, "vpp": 1}, "schedule": schedule,
            "batch": {"global": 32, "micro": 8, "num_microbatches": 4}, "recompute": "full",
            "stages": [{"layers": list(l), "replicas": 1, "ranks": [i]} for i, l in enumerate(layers)],
            "predicted": {"iteration_time_s": 1.0, "samples_per_s": 8.0, "tflops_per_device": 0.0,
                          "bubble_fraction": 0.0, "memory_bytes_per_device": 0.0}, **extra}
    path.write_text(json.dumps(plan))
    return str(path)


def test_plan_replaces_degrees_split_schedule_and_batch(tmp_path):
    cfg = compose_config([f"parallel.plan={write_plan(tmp_path / 'plan.json')}", "parallel.pp=7"])
    spec = build_run_spec(apply_plan(cfg), world_size=2)
    assert spec.layout.pp == 2 and spec.schedule.name == "gpipe" and spec.recompute.full
    assert spec.bounds == ((0, 2), (2, 6)) and spec.global_batch == 32 and spec.microbatches == 4


def test_plan_carries_recompute_num_layers(tmp_path):
    cfg = compose_config([f"parallel.plan={write_plan(tmp_path / 'plan.json', recompute_num_layers=1)}",
                          "recompute.num_layers=3"])
    assert build_run_spec(apply_plan(cfg), world_size=2).recompute.num_layers == 1   # the plan's, as priced
    cfg = compose_config([f"parallel.plan={write_plan(tmp_path / 'all.json')}", "recompute.num_layers=3"])
    assert build_run_spec(apply_plan(cfg), world_size=2).recompute.num_layers is None
    cfg = compose_config([f"parallel.plan={write_plan(tmp_path / 'bad.json', recompute_num_layers=-2)}"])
    with pytest.raises(ConfigError, match="plan recompute_num_layers = -2 must be an integer >= 0"):
        apply_plan(cfg)


def test_plan_world_size_and_model_mismatch_are_one_line(tmp_path):
    cfg = compose_config([f"parallel.plan={write_plan(tmp_path / 'plan.json')}"])
    with pytest.raises(ConfigError, match="the plan needs 2 processes .* but WORLD_SIZE = 4"):
        check_plan_world_size(cfg, 4)
    cfg = compose_config([f"parallel.plan={write_plan(tmp_path / 'p8.json', ((0, 4), (4, 8)), 8)}"])
    with pytest.raises(ConfigError, match="splits 8 layers but model=gpt has 6 pipeline layers"):
        apply_plan(cfg)


def test_a_planner_plan_for_bert_applies(tmp_path, capsys):
    """The planner counts BERT's embedding and head as pipeline layers, as the runtime does."""
    from planner.__main__ import main as planner_main

    path = tmp_path / "bert.json"
    model = ["model=bert_tiny", "model.hidden_size=32", "model.num_heads=2", "model.seq_len=16"]
    assert planner_main(model + ["cluster=local_cpu", "train.global_batch_size=8", "planner.pp=2",
                                 f"planner.out={path}"]) == 0, capsys.readouterr().err
    cfg = compose_config(model + ["train.global_batch_size=8", f"parallel.plan={path}"])
    check_plan_world_size(cfg, 2)
    spec = build_run_spec(apply_plan(cfg), world_size=2)
    assert spec.num_layers == 4 and spec.layout.pp == 2
    assert spec.bounds[0][0] == 0 and spec.bounds[-1][1] == 4 and spec.global_batch == 8


def test_zero_bubble_plans(tmp_path):
    """A zb_h2 plan trains as planned; a zbv plan (priced per rank, no V split) is one line."""
    cfg = compose_config([f"parallel.plan={write_plan(tmp_path / 'zb.json', schedule='zb_h2')}"])
    spec = build_run_spec(apply_plan(cfg), world_size=2)
    assert spec.schedule.name == "zb_h2" and spec.bounds == ((0, 2), (2, 6))
    cfg = compose_config([f"parallel.plan={write_plan(tmp_path / 'zbv.json', schedule='zbv')}"])
    with pytest.raises(ConfigError, match="train it with schedule=zbv parallel.pp=2 without parallel.plan") as error:
        apply_plan(cfg)
    assert "\n" not in str(error.value)


def test_a_plan_for_another_model_or_global_batch_is_refused_in_one_line(tmp_path):
    path = write_plan(tmp_path / "plan.json")
    planned = compose_config([f"parallel.plan={path}"])
    assert apply_plan(planned, model_label="gpt_tiny").train.global_batch_size == 32
    refusals = {"another model's name": (planned, "bert_tiny", "was made for model=gpt_tiny but this run trains "
                                                               "model=bert_tiny"),
                "a model.* setting": (compose_config([f"parallel.plan={path}", "model.hidden_size=64"]), None,
                                      "was made for a gpt_tiny of 834,304 parameters but this run's model has "),
                "another global batch": (compose_config([f"parallel.plan={path}", "train.global_batch_size=64"]),
                                         None, "was made for train.global_batch_size=32 but this run sets 64: pass "
                                               "train.global_batch_size=32")}
    for what, (cfg, label, message) in refusals.items():
        with pytest.raises(ConfigError, match=re.escape(message)) as error:
            apply_plan(cfg, model_label=label)
        assert "\n" not in str(error.value), what


@pytest.mark.parametrize("zero, distributed", [(3, "zero3"), (2, "zero2"), (1, True), (0, False)])
def test_plan_sets_context_parallelism_and_the_zero_level(tmp_path, zero, distributed):
    stages = [{"layers": [0, 2], "replicas": 1, "ranks": [0, 1]}, {"layers": [2, 6], "replicas": 1, "ranks": [2, 3]}]
    path = write_plan(tmp_path / "plan.json", context_parallel=2, zero=zero, distributed_optimizer=zero >= 1,
                      stages=stages)
    planned = apply_plan(compose_config([f"parallel.plan={path}", "optim.distributed=true"]))
    assert planned.parallel.cp == 2 and planned.optim.distributed == distributed
    assert planned.optim.reshard_after_forward is False


def test_plan_sets_reshard_after_forward(tmp_path):
    stages = [{"layers": [0, 2], "replicas": 1, "ranks": [0, 1]}, {"layers": [2, 6], "replicas": 1, "ranks": [2, 3]}]
    path = write_plan(tmp_path / "plan.json", context_parallel=2, zero=3, distributed_optimizer=True,
                      reshard_after_forward=True, stages=stages)
    planned = apply_plan(compose_config([f"parallel.plan={path}"]))
    assert planned.optim.distributed == "zero3" and planned.optim.reshard_after_forward is True


def test_an_older_plan_sets_cp_1_and_its_distributed_optimizer(tmp_path):
    planned = apply_plan(compose_config([f"parallel.plan={write_plan(tmp_path / 'p.json', distributed_optimizer=True)}",
                                         "parallel.cp=4"]))
    assert planned.parallel.cp == 1 and planned.optim.distributed is True
