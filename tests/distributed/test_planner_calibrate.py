"""python -m planner.calibrate for real (two processes over Gloo), then a plan from its sheet: the
measured profile, network and optimizer numbers are what the prediction is built of."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

from planner.__main__ import main as planner_main
from planner.calibrate.fit import LARGEST_MESSAGE_BOUND, THEIL_SEN
from pipedream.config.plan_file import load_plan

ROOT = Path(__file__).resolve().parents[2]


def test_calibrate_writes_a_sheet_the_planner_plans_with(tmp_path, capsys):
    sheet_path = tmp_path / "sheet.json"
    cmd = [sys.executable, "-m", "planner.calibrate", "model=gpt_tiny", f"planner.calibration_out={sheet_path}",
           "planner.calibrate_micro_batches=[1,4]", "planner.calibrate_repeats=3"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {sheet_path}" in proc.stdout
    sheet = json.loads(sheet_path.read_text())
    assert sheet["device"]["flops_fp32"] > 1e8 and sheet["process_base_bytes"] > 50 * 2**20
    assert sheet["p2p"]["bandwidth"] > 0 and sheet["allreduce"]["bandwidth"] > 0
    assert sheet["optimizer"]["seconds_per_parameter_byte"] > 0
    (entry,) = sheet["profiles"].values()
    layers = entry["profile"]["layers"]
    assert entry["model"] == "gpt_tiny" and len(layers) == 6 and all(min(la["forward_s"]) > 0 for la in layers)
    tp_layers = entry["profiles_tp"]["2"]["layers"]  # the layers split two ways, timed with their all-reduces
    assert len(tp_layers) == 6 and sum(la["parameter_bytes"] for la in tp_layers) < sum(la["parameter_bytes"]
                                                                                     for la in layers)
    flush = entry["runtime"]["flush"]  # from the traced 1f1b run
    assert flush["message_s"] > 0 and flush["step_s"] >= 0 and entry["runtime"]["process_bytes"] >= 0
    assert "runtime (flush run)" in proc.stdout

    plan_path = tmp_path / "plan.json"
    code = planner_main(["cluster=measured", f"cluster.calibration={sheet_path}", "train.global_batch_size=8",
                         "train.micro_batch_size=4", "planner.pp=2", "planner.dp=1", "planner.schedules=[1f1b]",
                         "planner.recompute=[false]", f"planner.out={plan_path}"])
    assert code == 0, capsys.readouterr().err
    plan = load_plan(plan_path)
    assert plan.planner["profile_source"] == "measured" and plan.planner["device"] == "measured"
    compute = sum(la["forward_s"][-1] + la["backward_s"][-1] for la in layers)  # b = 4, the last size
    # two micro-batches through two stages: at least the whole model's compute once, at most the 3 slots
    assert compute <= plan.predicted.iteration_time_s <= 3 * compute + 1.0


def test_calibrating_a_second_model_keeps_the_first(tmp_path):
    sheet_path = tmp_path / "sheet.json"
    for over in (["model=gpt_tiny"], ["model=gpt_tiny", "model.hidden_size=64", "model.num_heads=2"]):
        cmd = [sys.executable, "-m", "planner.calibrate", *over, f"planner.calibration_out={sheet_path}",
               "planner.calibrate_micro_batches=[2]", "planner.calibrate_repeats=2", "planner.calibrate_runtime=false"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
    assert len(json.loads(sheet_path.read_text())["profiles"]) == 2


def test_planner_only_model_is_refused_in_one_line(tmp_path):
    cmd = [sys.executable, "-m", "planner.calibrate", "model=gpt_1t", f"planner.calibration_out={tmp_path / 's.json'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "is planner-only" in proc.stderr


EXAMPLE = ROOT / "examples" / "masked_sequences"
PLUGIN = ["model._target_=maskseq.model.build", "model.width=16"]


def test_a_plugin_model_calibrates_and_plans_on_the_sheet(tmp_path, capsys, monkeypatch):
    """The example project's model and data, given as to the launcher; refused in the launcher's one
    line without its data, measured with it, then planned with cluster=measured."""
    monkeypatch.syspath_prepend(str(EXAMPLE))   # the in-process planner and ...
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLE), os.environ.get("PYTHONPATH", "")])}  # ... calibrate
    sheet_path = tmp_path / "sheet.json"
    base = [sys.executable, "-m", "planner.calibrate", *PLUGIN, f"planner.calibration_out={sheet_path}"]
    refused = subprocess.run(base, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "error: model._target_=maskseq.model.build needs its data as a plugin too: give "
        "data._target_=my_pkg.my_module.build_datasets (docs/models.md)"]
    cmd = [*base, "data._target_=maskseq.data.build", "planner.calibrate_micro_batches=[2]",
           "planner.calibrate_repeats=2", "planner.calibrate_runtime=false"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    (entry,) = json.loads(sheet_path.read_text())["profiles"].values()
    assert entry["model"] == "maskseq.model.build" and len(entry["profile"]["layers"]) == 4

    plan_path = tmp_path / "plan.json"
    code = planner_main([*PLUGIN, "cluster=measured", f"cluster.calibration={sheet_path}", "train.global_batch_size=4",
                         "train.micro_batch_size=2", "planner.algorithm=ptdp", "planner.pp=2", "planner.dp=1",
                         "planner.schedules=[1f1b]", "planner.recompute=[false]", f"planner.out={plan_path}"])
    assert code == 0, capsys.readouterr().err
    plan = load_plan(plan_path)
    assert plan.planner["profile_source"] == "measured" and plan.parallel.pp == 2
    layers = entry["profile"]["layers"]
    compute = sum(la["forward_s"][0] + la["backward_s"][0] for la in layers)   # b = 2, the one size
    assert compute <= plan.predicted.iteration_time_s <= 3 * compute + 1.0

    # the planner's free choice (PipeDream's DP for the plugin's uneven layers) from the fitted network:
    # a finite bandwidth (a fallback is stated), no NaN cut, a finite positive prediction for the batch asked
    sheet = json.loads(sheet_path.read_text())
    assert all(0 < sheet[k]["bandwidth"] < math.inf for k in ("p2p", "allreduce"))
    assert sheet["p2p"]["method"] in (THEIL_SEN, LARGEST_MESSAGE_BOUND)
    assert ("warning: p2p one-way times do not rise" in proc.stderr) == (sheet["p2p"]["method"] != THEIL_SEN)
    free_path = tmp_path / "free.json"
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        code = planner_main([*PLUGIN, "cluster=measured", f"cluster.calibration={sheet_path}",
                             "train.global_batch_size=4", "planner.simulate=false", f"planner.out={free_path}"])
    assert code == 0, capsys.readouterr().err
    free = load_plan(free_path)
    assert 0 < free.predicted.iteration_time_s < math.inf and free.batch.global_batch == 4
