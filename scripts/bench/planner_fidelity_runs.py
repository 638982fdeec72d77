"""What ``scripts/bench/planner_fidelity.py`` runs: the models and their data (the example
project's plugin model ``maskseq`` with its own data, importable by the subprocesses), the
calibrations and the launcher's runs; and ``--merge``, which puts freshly measured rows (e.g. only
the plugin's, ``--only maskseq``) into a saved result without running the others again."""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from scripts import ROOT
from scripts.bench.load import cpu_busy_jiffies, other_load

# name -> Hydra overrides of the model group (the calibration measures each); untied embeddings so
# that the asynchronous schedules (whose stages update at different times) run the same models
MODELS = {
    "gpt_tiny": ("model=gpt_tiny", "model.tie_embeddings=false"),
    "gpt_tiny_h256": ("model=gpt_tiny", "model.tie_embeddings=false", "model.hidden_size=256", "model.num_heads=8"),
    "maskseq": ("model._target_=maskseq.model.build", "model.width=128"),   # examples/masked_sequences
}
# the data each model trains on (calibrated and run with); a plugin model brings its own
DATA = {"maskseq": ("data._target_=maskseq.data.build", "data.num_samples=4096")}
SYNTHETIC = ("data=synthetic",)
PLUGIN_PATH = ROOT / "examples" / "masked_sequences"   # the plugin's package, importable by the subprocesses


def model_and_data(model: str) -> list[str]:
    """The overrides that select the model and its data, as the launcher and the calibration take them."""
    return [*MODELS[model], *DATA.get(model, SYNTHETIC)]


def plugin_env() -> dict[str, str]:
    """This environment with the example plugin's package on PYTHONPATH."""
    path = os.pathsep.join(p for p in (str(PLUGIN_PATH), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def launch_plan(model: list[str], plan_path: Path, run_dir: Path, steps: int, port_base: int, timeout: int) -> dict:
    """Train ``plan_path`` with the launcher (``model``: the overrides of the model and its data, the
    synthetic data unless they choose one): its summary, the wall time and the other processes' CPU
    share, or the run's one-line error."""
    if not any(o.lstrip("+~").startswith("data") for o in model):
        model = [*model, *SYNTHETIC]
    planned_batch = json.loads(plan_path.read_text())["batch"]["global"]   # the launcher refuses another
    cmd = [sys.executable, "-m", "launcher", *model, "cluster=local_cpu", f"parallel.plan={plan_path}",
           f"train.global_batch_size={planned_batch}",
           f"train.steps={steps}", "train.eval_every=0", "trace.enabled=false", "train.progress=false",
           f"train.log_every={steps}", f"train.run_dir={run_dir}", "train.overwrite=true",
           "launcher.check_memory=false", f"launcher.master_port={port_base + os.getpid() % 300}"]
    before, child = cpu_busy_jiffies(), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=plugin_env(), capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:  # recorded, not fatal: one failing configuration must not lose the others
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")] or proc.stderr.splitlines()
        return {"error": (lines[-1] if lines else f"exit {proc.returncode}")[:300], "wall_s": wall}
    own = (after.ru_utime + after.ru_stime) - (child.ru_utime + child.ru_stime)
    return {"summary": json.loads((run_dir / "summary.json").read_text()), "wall_s": wall,
            "other_load": other_load(before, cpu_busy_jiffies(), own)}


def calibrate(path: Path, repeats: int, models: set[str]) -> None:
    for model in MODELS:
        if model not in models:
            continue
        cmd = [sys.executable, "-m", "planner.calibrate", *model_and_data(model), f"planner.calibration_out={path}",
               f"planner.calibrate_repeats={repeats}"]
        proc = subprocess.run(cmd, cwd=ROOT, env=plugin_env(), capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"calibration of {model} failed: {proc.stderr.strip()}")
        print(proc.stdout.strip(), flush=True)


def summarise(rows: list[dict], choices: list[dict]) -> dict:
    """The targets' figures over ``rows`` (step and RSS errors) and ``choices`` (the first choice's gap)."""
    errors = [abs(r["step_error"]) for r in rows]
    loads = [x for r in rows for x in r["other_load"] if x is not None]
    return {"median_abs_step_error": statistics.median(errors), "worst_abs_step_error": max(errors),
            "median_abs_rss_error": statistics.median(abs(r["rss_error"]) for r in rows),
            "worst_choice_gap": max((c["gap"] for c in choices), default=float("nan")),
            "median_other_load": statistics.median(loads) if loads else None}


def merge(saved: dict, fresh: dict, remeasured: Callable[[str], bool] = lambda name: False) -> dict:
    """``saved`` with ``fresh``'s rows, first choices and failures in place of those of the same name
    (added where new), the summary over all of them, and under ``later`` when, on which calibration
    and under what load the fresh rows were measured. ``remeasured(name)``: saved rows that the
    fresh run selected (``--only``) are dropped even where no fresh row has their name (a first
    choice that changed, a configuration renamed), so no stale row of the same model stays."""
    def replaced(old: list[dict], new: list[dict], key: str) -> list[dict]:
        names = {n[key] for n in new}
        return [o for o in old if o[key] not in names and not (key == "name" and remeasured(o[key]))] + new

    rows = replaced(saved["rows"], fresh["rows"], "name")
    choices = replaced(saved["choices"], fresh["choices"], "model")
    fresh_names = {r["name"] for r in fresh["rows"]} | {f["name"] for f in fresh.get("failed", [])}
    failed = [f for f in saved.get("failed", []) if f["name"] not in fresh_names and not remeasured(f["name"])] \
        + fresh.get("failed", [])
    later = [x for x in saved.get("later", []) if not all(n in fresh_names or remeasured(n) for n in x["rows"])]
    later.append({"rows": sorted(fresh_names), "machine": fresh["machine"], "steps": fresh["steps"],
                  "repeats": fresh["repeats"], "calibration": fresh["calibration"],
                  "calibrations": fresh["calibrations"], "summary": fresh["summary"]})
    return {**saved, "rows": rows, "choices": choices, "failed": failed, "later": later,
            "summary": summarise(rows, choices)}
