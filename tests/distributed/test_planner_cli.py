"""The dry run end to end, and every bad input ending in one line with a non-zero exit."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from planner.__main__ import main
from planner.inputs.graph_txt import import_graph
from pipedream.config.plan_file import load_plan
from tests.support.planner_helpers import BRANCHY, CHAIN

ROOT = Path(__file__).resolve().parents[2]


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_dry_run_dgx_writes_a_valid_plan(capsys, tmp_path):
    out_path = tmp_path / "plan.json"
    code, out, err = run(capsys, "model=gpt3_175b", "cluster=dgx_a100", "cluster.nodes=12",
                         "train.global_batch_size=1536", f"planner.out={out_path}")
    assert code == 0, err
    for word in ("degrees", "layer split", "micro-batch", "schedule", "recomputation", "iteration time",
                 "samples/s", "TFLOP/s per device", "memory per device", "bubble", "why it lost", "eq. 4.4"):
        assert word in out
    plan = load_plan(out_path)
    assert plan.world_size == 96 and plan.parallel.pp * plan.parallel.tp * plan.parallel.dp == 96
    assert plan.model.num_layers == 98 and plan.planner["algorithm"] == "ptdp"
    assert plan.planner["simulator"]["ran"]
    assert plan.alternatives and all(a["why_lost"] for a in plan.alternatives)
    assert plan.predicted.memory_bytes_per_device <= plan.predicted.memory_capacity_bytes


def test_dry_run_cnn_picks_pipedream(capsys):
    code, out, _ = run(capsys, "model=vgg16", "cluster=pipedream_cluster_a", "train.global_batch_size=256")
    assert code == 0
    assert "algorithm: pipedream" in out and "layers differ in cost" in out
    assert "data parallelism" in out  # the DP baseline is among the alternatives


def test_dry_run_2bw(capsys):
    code, out, _ = run(capsys, "model=gpt_1.7b", "cluster=v100_16gb_x8", "cluster.nodes=1",
                       "train.global_batch_size=512", "planner.algorithm=2bw")
    assert code == 0
    assert "algorithm: 2bw" in out and "weights lag by one version" in out
    assert "schedule               2bw" in out and "simulator check" in out


@pytest.mark.parametrize("args, message", [
    (["cluster=nope"], "cluster=nope is unknown: choose one of"),
    (["model=gpt_1.7b", "cluster=dgx_a100", "train.global_batch_size=7"], "no configuration"),
    (["model=gpt_1.7b", "train.global_batch_size=10", "train.micro_batch_size=4"], "is not a multiple of"),
    (["model=gpt_1t", "cluster=dgx_a100", "cluster.nodes=1", "train.global_batch_size=8"],
     r"fits no configuration on 8 x a100_80gb: the smallest needs \d+\.\d GiB per device"),
    (["planner.algorithm=magic"], "planner.algorithm='magic' is unknown"),
])
def test_bad_input_is_one_line(capsys, args, message):
    code, out, err = run(capsys, *args)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1
    import re
    assert re.search(message, err), err


def test_branchy_graph_txt_plans(capsys, tmp_path):
    graph = tmp_path / "graph.txt"
    graph.write_text(BRANCHY)
    code, out, err = run(capsys, f"planner.graph={graph}", "cluster=pipedream_cluster_a", "cluster.nodes=1",
                         "train.global_batch_size=64")
    assert code == 0, err
    assert "3 layers" in out


@pytest.mark.parametrize("model", ["vgg16", "alexnet", "resnet50", "gnmt"])
def test_pipedream_dag_profiles_plan(capsys, tmp_path, model):
    from tests.support.graph_txt_profiles import write_profiles

    graph = write_profiles(tmp_path)[model]
    out_path = tmp_path / "plan.json"
    code, out, err = run(capsys, f"planner.graph={graph}", "planner.graph_micro_batch=32", "cluster=pipedream_cluster_a",
                         "cluster.nodes=1", "train.global_batch_size=256", f"planner.out={out_path}")
    assert code == 0, err
    assert f"Plan for graph:{model} " in out
    plan = load_plan(out_path)   # every node a layer (tests/unit/planner/inputs/test_profile.py counts them)
    assert plan.model.num_layers == import_graph(graph, 32).num_layers
    assert plan.world_size <= 4 and plan.stages[-1].layers[1] == plan.model.num_layers


def test_plan_world_size_mismatch(capsys, tmp_path):
    path = tmp_path / "plan.json"
    assert run(capsys, "model=gpt_tiny", f"planner.out={path}")[0] == 0
    code, out, _ = run(capsys, f"planner.validate={path}", "planner.world_size=2")
    assert code == 0 and "valid plan for 2 processes" in out
    code, _, err = run(capsys, f"planner.validate={path}", "planner.world_size=3")
    assert code == 2 and "WORLD_SIZE = 3" in err and err.count("\n") == 1


def test_subprocess_exit_code_and_no_outputs_dir(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "planner", "cluster=nope"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    proc = subprocess.run([sys.executable, "-m", "planner", "model=gpt_1.7b", "cluster=dgx_a100",
                           "train.global_batch_size=512", "planner.simulate=false"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "outputs").exists() and not (tmp_path / ".hydra").exists()


def test_graph_txt_chain_plans_with_pipedream(capsys, tmp_path):
    graph = tmp_path / "graph.txt"
    graph.write_text(CHAIN)
    code, out, err = run(capsys, f"planner.graph={graph}", "planner.graph_micro_batch=4", "cluster=pipedream_cluster_a",
                         "cluster.nodes=1", "train.global_batch_size=64", "planner.algorithm=pipedream")
    assert code == 0, err
    assert "algorithm: pipedream" in out and "3 layers" in out


def test_measured_profile_file_is_used(capsys, tmp_path):
    from pipedream.devices import DEVICES
    from planner.inputs.model_specs import TransformerSpec
    from planner.inputs.profile import analytic_profile

    prof = analytic_profile(TransformerSpec("gpt_tiny", "gpt", 4, 128, 4, 64, 256, "fp32"), DEVICES["v100_16gb"])
    path = tmp_path / "profile.json"
    prof.save(path)
    code, out, err = run(capsys, f"planner.profile={path}")
    assert code == 0, err
    assert "tensor-parallel degrees [1]" in out  # a profile file plans without tensor parallelism
