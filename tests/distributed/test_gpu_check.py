"""scripts/gpu_check.sh --dry-run on a CPU machine: the command list and the report writer run, so a
machine with a GPU runs the same script with no edits."""
from __future__ import annotations

import json
import os
import subprocess

from scripts import ROOT


def test_dry_run_writes_the_report_with_every_step_listed(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_CHECK_WORK": str(tmp_path / "work")}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    steps = {step["name"]: step for step in report["steps"]}
    assert report["dry_run"] and set(steps) == {"device_facts", "gpu_tests", "train_fp32", "train_bf16", "train_fp16",
                                                "harmony_pp", "multi_model_4", "train_bf16_compile",
                                                "train_bf16_selective", "llama_bf16", "gpt_wide_bf16",
                                                "harmony_pp_bf16", "single_model_bf16"}
    assert all(step["status"] == "dry_run" for step in steps.values())
    assert "-m gpu" in steps["gpu_tests"]["command"] and "precision=bf16" in steps["train_bf16"]["command"]
    assert "train.compile=true" in steps["train_bf16_compile"]["command"]
    assert "model=llama_tiny" in steps["llama_bf16"]["command"] and "model=gpt_small" not in steps["llama_bf16"]["command"]
    markdown = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "dry run: nothing was run" in markdown and "multi_model_4" in markdown


def test_an_unknown_argument_is_refused_in_one_line(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--fast"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "--fast" in done.stderr
