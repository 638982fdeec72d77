"""The runtime's own costs, measured from traces of short real runs (part of ``planner.calibrate.sheet``).

For each schedule family (a flush schedule, 2BW, PipeDream) one two-stage run of the model is
trained with the launcher and traced (``pipedream.observe.trace``). Per rank and traced iteration:

* ``message_s``: the mean duration of its send and receive actions (posting them, Gloo's work);
* ``compute_action_s``: the time between its first and last action that is neither a wait for an
  input, nor a message, nor inside a FWD or BWD action, per FWD or BWD action (the executor's Python
  between actions, version swaps and stashing of the asynchronous schedules); for PipeDream, which
  updates after every input, its updates (the STEP and SYNC actions between the others) are left out;
* ``update_s`` (PipeDream): an update's STEP action less the optimizer fit's share of the rank's
  parameters (the clipping norm, the scheduler, zeroing, keeping a stashed version), per update;
* ``layer_time_ratio``: the FWD and BWD actions' time over the profiled layers' (a stage's layers in
  a training step run slower than each layer timed alone, by a factor rather than a constant per
  action; the planner multiplies the profile by the least of the families' ratios:
  ``planner.inputs.runtime_costs.layer_pace``);
* ``step_s``: the time before the first and after the last action (the flush's gradient
  synchronisation, the clipping norm, the optimizer step, zeroing) less the optimizer fit's share
  (PipeDream: less its updates there, which ``update_s`` counts);
* the peak RSS beyond the process's base and the model's bytes as the planner counts them.

Each is the median over ranks and traced iterations (one iteration stalled by another process on a
shared machine does not set it); the planner adds them where they occur
(``planner.inputs.runtime_costs``). Waits are the bubble, which the schedule's formula models.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from pipedream.schedules import schedule_info

from planner.costs import closed_form as cost
from planner.errors import PlannerError
from planner.inputs.profile import profile_from_json
from planner.costs.uniform import even_boundaries

RUN_SCHEDULES = {"flush": "1f1b", "2bw": "2bw", "pipedream": "pipedream"}
STEPS, TRACED = 15, tuple(range(4, 16))   # 12 traced iterations: a step here varies by +-25%
GLOBAL_BATCH, MICRO = 32, 4
_ACTIONS = ("forward", "backward", "send", "recv", "wait")


def run_overrides(model_overrides: Sequence[str]) -> list[str]:
    """The overrides that select the model and its data (``model=``/``model.*``, ``data=``/``data.*``,
    a plugin's ``_target_`` included), as the traced runs pass them to the launcher; the synthetic
    data unless they choose data."""
    chosen = [o for o in model_overrides if o.lstrip("+~").partition("=")[0].split(".")[0] in ("model", "data")]
    has_data = any(o.lstrip("+~").partition("=")[0].split(".")[0] == "data" for o in chosen)
    return chosen if has_data else [*chosen, "data=synthetic"]


def check_as_launcher(overrides: Sequence[str]) -> None:
    """A plugin model or data (``model._target_``, ``data._target_``) composed and checked as
    ``python -m launcher`` does before it launches: the launcher's one-line refusals (a ConfigError),
    before anything is measured."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from models.plugin_config import plugin_target
    from pipedream.config.loading import compose_config, describe_composition_error
    from pipedream.config.run_spec import build_run_spec

    try:
        cfg = compose_config(overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise PlannerError(describe_composition_error(err, overrides)) from None
    if plugin_target(cfg.model) is not None or plugin_target(cfg.data) is not None:
        build_run_spec(cfg)


def traced_run(model_overrides: Sequence[str], schedule: str, layers: list[int], run_dir: Path) -> dict:
    """Train ``STEPS`` steps of the model as a 2-stage pipeline; its trace and summary."""
    root = Path(__file__).resolve().parents[2]   # the repository (this file is planner/calibrate/)
    cmd = [sys.executable, "-m", "launcher", *run_overrides(model_overrides), "cluster=local_cpu", "parallel.pp=2",
           f"parallel.layers_per_stage=[{','.join(str(n) for n in layers)}]", f"schedule={schedule}",
           f"train.global_batch_size={GLOBAL_BATCH}", f"train.micro_batch_size={MICRO}", f"train.steps={STEPS}",
           "train.eval_every=0", "trace.enabled=true", f"trace.steps=[{','.join(str(s) for s in TRACED)}]",
           "train.progress=false", f"train.log_every={STEPS}", f"train.run_dir={run_dir}", "train.overwrite=true",
           "launcher.check_memory=false", f"launcher.master_port={29900 + os.getpid() % 97}"]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")] or proc.stderr.splitlines()
        return {"error": (lines[-1] if lines else f"exit {proc.returncode}")[:300]}
    return {"trace": json.loads((run_dir / "trace" / "trace.json").read_text()),
            "summary": json.loads((run_dir / "summary.json").read_text())}


def overheads(trace: dict, layer_seconds: list[float], optimizer_s: list[float],
              per_update: bool = False) -> dict[str, float]:
    """The costs (and the layers' time ratio) from a Chrome trace; ``layer_seconds[r]``: the
    profiled forward + backward of rank r's layers per micro-batch, ``optimizer_s[r]``: the optimizer
    fit for its parameters; ``per_update``: updates happen between the actions (PipeDream), so they
    are measured per update (``update_s``) instead of per action."""
    steps: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            steps[(e["pid"], e["args"]["step"])].append(e)
    action_s, message_s, step_s, layer_ratio, update_s = [], [], [], [], []
    for (rank, _), events in steps.items():
        iteration = next(e for e in events if e["cat"] == "iteration")
        actions = [e for e in events if e["cat"] in _ACTIONS]
        forwards = sum(1 for e in events if e["cat"] == "forward" and e["name"].startswith("F"))
        messages = [e["dur"] for e in events if e["cat"] in ("send", "recv")]
        if not actions or not forwards:
            continue
        first = min(e["ts"] for e in actions)
        last = max(e["ts"] + e["dur"] for e in actions)
        waits = sum(e["dur"] for e in events if e["cat"] == "wait")
        computing = sum(e["dur"] for e in events if e["cat"] in ("forward", "backward"))
        # PipeDream's updates (STEP and SYNC actions) lie between the others and before the first
        updates = [e for e in events if per_update and e["cat"] in ("step", "sync")]
        update_s += [e["dur"] * 1e-6 - optimizer_s[rank] for e in updates if e["cat"] == "step"]
        inside = sum(e["dur"] for e in updates if first <= e["ts"] < last)
        # the layers are timed by the actions themselves, not by the profile: their slowdown over the
        # profile is a factor (layer_time_ratio), so only the time between actions is per action
        other = (last - first - waits - sum(messages) - computing - inside) * 1e-6
        action_s.append(other / (2 * forwards))
        layer_ratio.append(computing * 1e-6 / (forwards * layer_seconds[rank]))
        if messages:
            message_s.append(statistics.fmean(messages) * 1e-6)
        outside = (first - iteration["ts"]) + (iteration["ts"] + iteration["dur"] - last)
        if per_update:  # every update is charged per update, the fit's share with it
            step_s.append((outside - sum(e["dur"] for e in updates) + inside) * 1e-6)
        else:
            step_s.append(outside * 1e-6 - optimizer_s[rank])
    out = {"compute_action_s": max(0.0, statistics.median(action_s)),
           "message_s": statistics.median(message_s or [0.0]), "step_s": max(0.0, statistics.median(step_s)),
           "layer_time_ratio": statistics.median(layer_ratio)}  # traced F/B time / profile
    if per_update:
        out["update_s"] = max(0.0, float(statistics.median(update_s or [0.0])))
    return out


def planned_bytes(profile_json: dict, bounds: np.ndarray, schedule: str) -> list[float]:
    """Each rank's bytes as the planner counts them (weights x versions, gradients, optimizer state,
    the in-flight micro-batches' activations) for the traced run."""
    profile = profile_from_json(profile_json)
    col = profile.arrays
    p, m = len(bounds) - 1, GLOBAL_BATCH // MICRO
    out = []
    for r in range(p):
        part = slice(int(bounds[r]), int(bounds[r + 1]))
        flight = float(cost.in_flight(schedule, p, r, m))
        out.append(float(cost.device_memory(col["parameter_bytes"][part].sum(), col["optimizer_bytes"][part].sum(),
                                            cost.weight_versions(schedule, flight),
                                            MICRO * col["activation_bytes"][part].sum(), flight)))
    return out


def measure_runtime(model_overrides: Sequence[str], profile_json: dict, optimizer: dict,
                    process_base_bytes: float) -> dict[str, Any]:
    """The sheet's ``runtime`` section for one model (families whose run failed are left out, with
    the reason under ``errors``)."""
    profile = profile_from_json(profile_json)
    bounds = even_boundaries(profile, 2)
    fwd, bwd = profile.times(MICRO)
    layer_s = [float((fwd + bwd)[bounds[r]:bounds[r + 1]].sum()) for r in range(2)]
    params = profile.arrays["parameter_bytes"]
    opt_s = [float(optimizer["step_overhead_s"] + optimizer["seconds_per_parameter_byte"]
                   * params[bounds[r]:bounds[r + 1]].sum()) for r in range(2)]
    out: dict[str, Any] = {}
    errors, extra = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for family, schedule in RUN_SCHEDULES.items():
            run = traced_run(model_overrides, schedule, [int(b) for b in np.diff(bounds)], Path(tmp, family))
            if "error" in run:
                errors[family] = run["error"]
                continue
            out[family] = overheads(run["trace"], layer_s, opt_s, per_update=schedule_info(schedule).updates_per_microbatch)
            planned = planned_bytes(profile_json, bounds, schedule)
            ranks = sorted(run["summary"]["ranks"], key=lambda r: r.get("rank", 0))
            extra += [r["peak_memory_bytes"]["rss"] - process_base_bytes - planned[i] for i, r in enumerate(ranks)]
    if extra:
        out["process_bytes"] = max(0.0, statistics.median(extra))
    if errors:
        out["errors"] = errors
    return out
