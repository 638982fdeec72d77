"""The GPU check's comparisons: ratios read from the two runs' summaries, fused models counted."""
from __future__ import annotations

import importlib.util

import pytest

from scripts import ROOT


def _report_module():
    spec = importlib.util.spec_from_file_location("gpu_check_report", ROOT / "scripts" / "gpu_check_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train(name: str, step_s: float, allocated: int, loss: float, models=None) -> dict:
    summary = {"median_step_time_s": step_s, "peak_memory_bytes": {"allocated": allocated},
               "final_train_loss": loss}
    if models is not None:
        summary["models"] = models
    return {"name": name, "kind": "train", "summary": summary}


def test_comparisons_are_ratios_of_the_two_runs_and_count_fused_models():
    report = _report_module()
    steps = [_train("train_bf16", 0.2, 1000, 3.0), _train("train_bf16_compile", 0.1, 900, 3.01),
             _train("single_model_bf16", 0.05, 500, 3.0),
             _train("multi_model_4", 0.1, 1200, 12.0, models=[{"final_train_loss": 3.0 + k / 10} for k in range(4)]),
             {"name": "train_bf16_selective", "kind": "train", "summary": None}]
    rows = {row["run"]: row for row in report.comparisons(steps)}
    assert set(rows) == {"train_bf16_compile", "multi_model_4"}   # no summary: no row
    assert rows["train_bf16_compile"]["speedup"] == pytest.approx(2.0)
    assert rows["train_bf16_compile"]["peak_allocated_ratio"] == pytest.approx(0.9)
    assert rows["train_bf16_compile"]["loss_difference"] == pytest.approx(0.01)
    assert rows["multi_model_4"]["speedup"] == pytest.approx(4 * 0.05 / 0.1)
    assert rows["multi_model_4"]["loss_difference"] == pytest.approx(0.15)   # the models' mean, not their sum
    text = report.markdown({"written": "now", "dry_run": False, "device_line": "x", "facts": None,
                            "steps": [], "comparisons": list(rows.values())})
    assert "## Comparisons" in text and "2.00x" in text
