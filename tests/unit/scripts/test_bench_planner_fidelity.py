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
