"""scripts/bench/planner_fidelity.py without runs: --only's row filter and --repredict, which plans
saved rows again from saved calibrations and reports the error against what was measured."""
from __future__ import annotations

import json

import pytest

import scripts.bench.planner_fidelity as bench
import scripts.bench.planner_fidelity_runs as runs
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
    monkeypatch.setattr(runs.subprocess, "run", record)
    bench.calibrate(tmp_path / "sheet.json", 2, {"maskseq"})
    (calibrate, path), = commands
    assert calibrate[3:7] == ["model._target_=maskseq.model.build", "model.width=128",
                              "data._target_=maskseq.data.build", "data.num_samples=4096"]
    assert path == str(bench.PLUGIN_PATH) and (bench.PLUGIN_PATH / "maskseq" / "model.py").exists()
    launch = ["model._target_=maskseq.model.build", "data._target_=maskseq.data.build"]
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "plan.json").write_text('{"batch": {"global": 8}}')   # the launch repeats the plan's batch
    monkeypatch.setattr(runs.subprocess, "run", lambda cmd, **kw: commands.append((cmd, "")) or Done())
    bench.launch_plan(launch, tmp_path / "plan.json", tmp_path, 2, 29600, 10)
    assert "data=synthetic" not in commands[-1][0] and "train.global_batch_size=8" in commands[-1][0]
    bench.launch_plan(["model=gpt_tiny"], tmp_path / "plan.json", tmp_path, 2, 29600, 10)
    assert "data=synthetic" in commands[-1][0]


def test_merge_keeps_the_saved_rows_and_replaces_the_fresh_ones(tmp_path):
    sheet = {k: v for k, v in write_sheet(tmp_path / "sheet.json").items() if k != "profiles"}

    def row(name, error, load):
        return {"name": name, "step_error": error, "rss_error": error / 2, "other_load": [load]}
    saved = {"rows": [row("a", 0.1, 0.1), row("maskseq x", 0.9, 0.1)], "choices": [{"model": "gpt_tiny", "gap": 0.0}],
             "failed": [], "steps": 16, "repeats": 2, "summary": {}}
    fresh = {"rows": [row("maskseq x", -0.05, 0.8), row("maskseq y", 0.2, 0.8)],
             "choices": [{"model": "maskseq", "gap": 0.03}], "failed": [], "steps": 16, "repeats": 2,
             "machine": {"cpu": "c"}, "calibration": sheet, "calibrations": [sheet["machine_load"]]}
    fresh["summary"] = runs.summarise(fresh["rows"], fresh["choices"])
    merged = runs.merge(saved, fresh)
    assert [r["name"] for r in merged["rows"]] == ["a", "maskseq x", "maskseq y"]
    assert merged["rows"][1]["step_error"] == -0.05 and merged["steps"] == 16
    assert [c["model"] for c in merged["choices"]] == ["gpt_tiny", "maskseq"]
    assert merged["summary"]["worst_abs_step_error"] == pytest.approx(0.2)
    assert merged["summary"]["worst_choice_gap"] == pytest.approx(0.03)
    assert merged["later"][0]["rows"] == ["maskseq x", "maskseq y"]
    text = bench.later_text(merged["later"][0])
    assert text.startswith("The rows maskseq x, maskseq y were measured later (2 rounds of 16 steps)")
    assert "median 80% of the CPU during their runs" in text
    assert len(runs.merge(merged, fresh)["later"]) == 1   # measured again: the older note goes
    # --only maskseq: a saved maskseq row the fresh run no longer has (a changed first choice) goes too
    old_choice = {**saved, "rows": [*saved["rows"], row("maskseq old choice", 0.5, 0.1)],
                  "failed": [{"name": "maskseq broken", "error": "x"}],
                  "later": [{"rows": ["maskseq old choice", "maskseq x"]}]}
    kept = runs.merge(old_choice, fresh)
    assert "maskseq old choice" in [r["name"] for r in kept["rows"]] and len(kept["later"]) == 2
    only = runs.merge(old_choice, fresh, lambda name: bench.selected(name, "maskseq"))
    assert [r["name"] for r in only["rows"]] == ["a", "maskseq x", "maskseq y"]
    assert only["failed"] == [] and [x["rows"] for x in only["later"]] == [["maskseq x", "maskseq y"]]


@pytest.mark.parametrize("algorithm", ["pipedream", "ptdp"])
def test_a_chosen_plan_is_planned_again_as_the_grid_configuration(tmp_path, algorithm):
    """The first choice becomes a grid row: pinned to its degrees and micro-batch and planned again by
    the search that chose it, it is the same plan (a PipeDream choice re-planned by PTD-P was refused
    when its micro-batch exceeded the batch per pipeline, or became another plan)."""
    from planner.__main__ import main as planner_main

    sheet = tmp_path / "calibration0.json"
    write_sheet(sheet)
    chosen = tmp_path / "choice.json"
    assert planner_main([*bench.MODELS["gpt_tiny"], "cluster=measured", f"cluster.calibration={sheet}",
                         f"train.global_batch_size={bench.GLOBAL_BATCH}", "planner.simulate=false",
                         f"planner.algorithm={algorithm}", f"planner.out={chosen}"]) == 0
    choice = json.loads(chosen.read_text())
    cfg = bench.config_of("gpt_tiny", choice)
    assert cfg.algorithm == algorithm and cfg.micro * cfg.dp <= bench.GLOBAL_BATCH
    again = bench.plan(cfg, sheet, tmp_path / "again.json")
    for key in ("parallel", "schedule", "batch", "recompute", "stages"):
        assert again[key] == choice[key], key
    grown = {**choice, "batch": {**choice["batch"], "global": 2 * bench.GLOBAL_BATCH}}
    with pytest.raises(SystemExit, match=f"global batch {2 * bench.GLOBAL_BATCH}, not the {bench.GLOBAL_BATCH}"):
        bench.config_of("gpt_tiny", grown)
