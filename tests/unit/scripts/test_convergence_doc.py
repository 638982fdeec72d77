"""docs/convergence.md's markdown, from the numbers of its runs (no training): one table row per
evaluated step, however often metrics.jsonl logged it."""
from __future__ import annotations

import argparse

from scripts import ROOT
from scripts.docs.convergence import markdown, val_curve

CURVES = {   # the committed report's validation losses at steps 50, 100, ..., 300
    "1f1b": [2.4623, 2.3352, 2.2230, 2.0877, 1.9945, 1.9289],
    "2bw": [3.0011, 2.7865, 2.8222, 2.6300, 2.5976, 2.5606],
    "pipedream": [2.4935, 2.3396, 2.1628, 2.0156, 1.8650, 1.8017],
}
ROWS = {   # schedule: updates per stage, optimizer batch, final train loss, weight versions, samples/s
    "1f1b": (300, 32, 1.8437, [1, 1], 120.0),
    "2bw": (300, 32, 2.6826, [2, 2], 104.8),
    "pipedream": (2400, 4, 1.6355, [2, 1], 112.1),
}


def records(losses: list[float]) -> list[dict]:
    """metrics.jsonl of a run logged twice over (appended), with steps between evaluations."""
    once = [{"step": s, "loss": 3.0} for s in range(25, 325, 50)] + \
           [{"step": 50 * (i + 1), "loss": 3.0, "val_loss": v} for i, v in enumerate(losses)]
    return once + once


def results() -> list[dict]:
    out = []
    for schedule, losses in CURVES.items():
        updates, batch, train_loss, versions, rate = ROWS[schedule]
        out.append({"schedule": schedule, "updates_per_stage": updates, "optimizer_batch": batch, "samples": 9600,
                    "final_val_loss": losses[-1], "final_train_loss": train_loss, "samples_per_s": rate,
                    "weight_versions": versions, "val_curve": val_curve(records(losses))})
    return out


def test_val_curve_keeps_one_value_a_step_the_last():
    assert val_curve([{"step": 100, "val_loss": 2.0}, {"step": 50, "val_loss": 3.0}, {"step": 100, "val_loss": 1.5},
                      {"step": 75, "loss": 9.0}]) == [(50, 3.0), (100, 1.5)]


def test_markdown_reproduces_the_committed_report_with_each_step_once():
    args = argparse.Namespace(pp=2, steps=300)
    text = markdown(results(), args, "python -m scripts.docs.convergence")
    assert text == (ROOT / "docs/convergence.md").read_text()
    curve_rows = [line for line in text.splitlines() if line.startswith("| ") and line.split(" | ")[0][2:].isdigit()]
    assert [int(row.split(" | ")[0][2:]) for row in curve_rows] == [50, 100, 150, 200, 250, 300]


def test_a_step_only_some_schedules_evaluated_shows_a_dash():
    rows = results()
    rows[1]["val_curve"] = rows[1]["val_curve"][:-1] + [(275, 2.6)] + rows[1]["val_curve"][-1:]
    text = markdown(rows, argparse.Namespace(pp=2, steps=300), "x")
    assert "| 275 | - | 2.6000 | - |" in text and text.count("\n| 300 |") == 1
