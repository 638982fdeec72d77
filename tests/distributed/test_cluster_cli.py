"""``python -m planner.cluster`` end to end in a fresh interpreter: an allocation for a jobs file with
its JSON, a small simulated trace with its plot, and bad input ending in one line with exit 2."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner.cluster", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_allocation_for_a_jobs_file(tmp_path):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(yaml.safe_dump({"jobs": [
        {"name": "bert", "model": "bert_large", "batch": 16, "steps": 20000, "scale_factor": 2},
        {"name": "resnet", "model": "resnet50", "batch": 64, "steps": 50000},
        {"name": "gpt", "model": "gpt_small", "batch": 16, "steps": 30000, "weight": 2},
        {"name": "measured", "model": "gpt_tiny", "batch": 32, "steps": 1000,
         "throughput": {"v100": 40.0, "p100": 30.0, "k80": 20.0}}],
        "space_sharing": True, "colocated": [{"jobs": ["resnet", "measured"], "throughput": {"v100": [3.0, 30.0]}}]}))
    out = tmp_path / "alloc.json"
    done = cli(f"jobs={jobs}", "fleet=gavel_physical", "policy=max_min_fairness", f"out={out}")
    assert done.returncode == 0, done.stderr
    assert "X v100" in done.stdout and "objective (max_min_fairness" in done.stdout
    data = json.loads(out.read_text())
    X = np.array([j["allocation"] for j in data["jobs"]])
    scale = np.array(data["scale_factors"])
    pair = data["pairs"][0]
    assert pair["jobs"] == ["resnet", "measured"] and pair["throughput_steps_per_s"][0] == [3.0, 30.0]
    assert np.all(X.sum(axis=1) + np.array([0, 1, 0, 1]) * sum(pair["allocation"]) <= 1 + 1e-6)
    assert np.all((X * scale[:, None]).sum(axis=0) + pair["allocation"] <= np.array(data["fleet"]["counts"]) + 1e-6)
    assert data["objective"] >= data["objective_agnostic"] - 1e-9
    assert data["jobs"][3]["throughput_steps_per_s"] == [40.0, 30.0, 20.0]
    assert "samples/s" in data["jobs"][0]["plans"]["v100"]


def test_simulated_trace_writes_json_and_plot(tmp_path):
    out, plot = tmp_path / "sim.json", tmp_path / "sim.png"
    done = cli("mode=simulate", "fleet=gavel_physical", "trace.jobs=12", "trace.rate_per_hour=2", "policy=fifo",
               f"out={out}", f"plot={plot}")
    assert done.returncode == 0, done.stderr
    assert "agnostic" in done.stdout and plot.stat().st_size > 1000
    rows = json.loads(out.read_text())["results"]
    assert [r["heterogeneity"] for r in rows] == ["aware", "agnostic"]
    assert all(r["finished"] == 12 for r in rows)


def test_bad_input_is_one_line(tmp_path):
    bad_jobs = tmp_path / "bad.yaml"
    bad_jobs.write_text(yaml.safe_dump([{"model": "gpt_tiny", "batch": -1, "steps": 10}]))
    for args, message in [(["policy=nope"], "policy='nope' is unknown"),
                          (["policy=hierarchical", "within=lifo"], "within='lifo' is unknown"),
                          (["fleet=nope"], "fleet=nope is unknown: choose one of gavel_physical"),
                          ([f"jobs={bad_jobs}"], "jobs[0].batch = -1 must be a positive integer"),
                          (["mode=simulate", "mechanism=magic"], "mechanism='magic' is unknown"),
                          (["trace.reference_type=tpu"], "trace.reference_type=tpu is not a type"),
                          (["trace.jobs=2", "space_sharing=true"], "space_sharing=true needs co-located throughputs")]:
        done = cli(*args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert done.stderr.startswith("error: ") and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert message in done.stderr, done.stderr
