"""scripts/bench/planner_fidelity.py without runs: --only's row filter and --repredict, which plans
saved rows again from saved calibrations and reports the error against what was measured."""
from __future__ import annotations

import json

import pytest

import scripts.bench.planner_fidelity as bench
from tests.unit.planner.calibrate.test_calibration import write_sheet


def test_only_selects_rows_by_any_part():
    assert bench.selected("gpt_tiny pipedream DP plan b=4", "pipedream DP|b=4 2bw")
    assert bench.selected("gpt_tiny p=2 d=1 t=1 b=4 2bw", "pipedream DP|b=4 2bw")
    assert not bench.selected("gpt_tiny_h256 p=2 d=1 t=1 b=8 2bw", "pipedream DP|b=4 2bw")
    assert bench.selected("anything", "")


def test_repredict_plans_the_saved_rows_again(tmp_path):
    for r in (0, 1):
        write_sheet(tmp_path / f"calibration{r}.json")
    cfg = bench.Config("gpt_tiny")
    row = {"config": bench.asdict(cfg), "name": cfg.name, "measured_step_s": 0.1, "predicted_step_s": 0.05,
           "step_error": -0.5}
    other = {**row, "name": "gpt_tiny p=1 d=2 t=1 b=8 1f1b"}
    data = {"repeats": 2, "rows": [row, other]}
    got = bench.repredict(data, tmp_path, only="b=4 1f1b")
    assert [r["name"] for r in got] == [cfg.name]
    now = bench.plan(cfg, tmp_path / "calibration0.json", tmp_path / "p.json")["predicted"]["iteration_time_s"]
    assert got[0]["now_s"] == pytest.approx(now)  # both sheets are the same: the median is either
    assert got[0]["now_error"] == pytest.approx(now / 0.1 - 1)
    assert "| gpt_tiny p=2 d=1 t=1 b=4 1f1b | 100.0 ms | 50.0 ms | -50% |" in bench.repredict_markdown(got)


def test_the_plugin_row_is_calibrated_and_run_with_its_own_data(monkeypatch, tmp_path):
    assert bench.Config("maskseq") in bench.grid(quick=False)
    commands = []

    class Done:
        returncode, stdout, stderr = 0, "", ""

    def record(cmd, **kwargs):
        commands.append((cmd, kwargs["env"]["PYTHONPATH"].split(":")[0]))
        return Done()
    monkeypatch.setattr(bench.subprocess, "run", record)
    bench.calibrate(tmp_path / "sheet.json", 2, {"maskseq"})
    (calibrate, path), = commands
    assert calibrate[3:7] == ["model._target_=maskseq.model.build", "model.width=128",
                              "data._target_=maskseq.data.build", "data.num_samples=4096"]
    assert path == str(bench.PLUGIN_PATH) and (bench.PLUGIN_PATH / "maskseq" / "model.py").exists()
    launch = ["model._target_=maskseq.model.build", "data._target_=maskseq.data.build"]
    (tmp_path / "summary.json").write_text("{}")
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **kw: commands.append((cmd, "")) or Done())
    bench.launch_plan(launch, tmp_path / "plan.json", tmp_path, 2, 29600, 10)
    assert "data=synthetic" not in commands[-1][0]
    bench.launch_plan(["model=gpt_tiny"], tmp_path / "plan.json", tmp_path, 2, 29600, 10)
    assert "data=synthetic" in commands[-1][0]
