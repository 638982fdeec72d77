"""harmony_pp's own costs, measured from traces of short real runs (part of ``planner.calibrate.sheet``).

The flush families' costs (``planner.calibrate.runtime``) miss what only Harmony's executor does:
weight swaps, stash files in shared memory, the host update, and its layers run differently from
the profile (a forward task runs without a graph; a backward task recomputes its pack into
preallocated gradients). So the model is trained with ``schedule=harmony_pp`` on 1 and on 2
processes, and on the sheet's own process count when that is more (one layer per pack, every
micro-batch in one group: every kind of action occurs) and traced. Per rank and traced
iteration, with the configuration's own action costs (``planner.harmony.tasks.ProfileCosts``)
from the model's layers timed alone right before and right after the run (the geometric mean of
the two ratios):

* ``forward_ratio`` / ``train_ratio``: the forward tasks' FWD time, and the graph-building passes'
  (the jit pack's FWD and BWD, the recomputing backward tasks' BWD), over those layer times (with
  two processes the contention between them is in it);
* ``swap_s``, ``stash_s``, ``update_s``: the median weight swap (SI/SO/PF of a pack), stash copy
  (SO<mb>/SI<mb>) and update less their modelled part (bytes at the swap bandwidth; the optimizer
  fit);
* ``message_s``: the median send or receive (posting it; a receive after its message arrived);
* ``action_s`` and ``compute_action_s``: the time between actions (the executor's Python), per
  action (the estimator charges the latter after FWD/BWD actions, the former after the others);
* ``step_s``: the iteration's time before its first and after its last action.

Each is the median over ranks and traced iterations. The estimator
(``planner.harmony.estimator.HarmonyOverheads``) charges them per action, from the most processes
calibrated up to the configuration's device count: more processes than cores time-slice, which
only their own runs measure (4 on 2 cores: layers 1.7-2.0x the profile's, against 1.1-1.2x with 2).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

from pipedream.schedules.harmony import FORWARD, harmony_config

from planner.calibrate.runtime import run_overrides
from planner.harmony.tasks import ProfileCosts
from planner.inputs.profile import Profile, mean_profile

PROCESSES = (1, 2)
STEPS, TRACED = 19, tuple(range(4, 20))   # 16 traced iterations: a step here varies by +-25%
LAUNCHES = 2   # per process count, the median of each cost: whole launches differ by 10-15% here
GLOBAL_BATCH, MICRO = 8, 2
_COMPUTE, _MESSAGES = ("forward", "backward"), ("send", "recv")
_RATIOS = ("forward_ratio", "train_ratio")


def traced_harmony_run(model_overrides: Sequence[str], processes: int, run_dir: Path) -> dict:
    """Train ``STEPS`` steps of harmony_pp on ``processes`` processes: its trace, or the run's one-line error."""
    root = Path(__file__).resolve().parents[2]   # the repository (this file is planner/calibrate/)
    cmd = [sys.executable, "-m", "launcher", *run_overrides(model_overrides), "cluster=local_cpu", "schedule=harmony_pp",
           f"parallel.pp={processes}", "train.grad_clip=0", f"train.global_batch_size={GLOBAL_BATCH}",
           f"train.micro_batch_size={MICRO}", f"train.steps={STEPS}", "train.eval_every=0", "trace.enabled=true",
           f"trace.steps=[{','.join(str(s) for s in TRACED)}]", "trace.timeline=false", "train.progress=false",
           f"train.log_every={STEPS}", f"train.run_dir={run_dir}", "train.overwrite=true",
           "launcher.check_memory=false", f"launcher.master_port={29700 + os.getpid() % 97}"]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")] or proc.stderr.splitlines()
        return {"error": (lines[-1] if lines else f"exit {proc.returncode}")[:300]}
    return {"trace": json.loads((run_dir / "trace" / "trace.json").read_text())}


def _task(event: dict) -> int:
    """The task (chunk) of a trace event: in its args, or after the dot of a pack action ("SI.2")."""
    if "chunk" in event["args"]:
        return int(event["args"]["chunk"])
    _, _, chunk = event["name"].partition(".")
    return int(chunk or 0)


def harmony_overheads(trace: dict, profile: Profile, processes: int, swap_bandwidth: float,
                      update_per_byte: float, update_overhead: float = 0.0) -> dict[str, float]:
    """The costs from the trace of a ``traced_harmony_run``, its actions costed from ``profile``."""
    config = harmony_config(profile.num_layers, GLOBAL_BATCH // MICRO, processes)
    costs = ProfileCosts(profile, config, MICRO)
    steps: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            steps[(e["pid"], e["args"]["step"])].append(e)
    per: dict[str, list[float]] = defaultdict(list)
    for events in steps.values():
        iteration = next(e for e in events if e["cat"] == "iteration")
        actions = [e for e in events if e["cat"] not in ("iteration", "wait")]
        if not actions:
            continue
        measured = {"forward": 0.0, "train": 0.0}
        profiled = {"forward": 0.0, "train": 0.0}
        for e in actions:
            seconds, task = e["dur"] * 1e-6, _task(e)
            if e["cat"] in _COMPUTE:
                forward = e["cat"] == "forward"
                side = "forward" if forward and config.tasks[task].role == FORWARD else "train"
                measured[side] += seconds
                profiled[side] += costs.forward_s(task) if forward else costs.backward_s(task)
            elif e["cat"] in _MESSAGES:
                per["message_s"].append(seconds)
            elif e["cat"] == "update":
                per["update_s"].append(seconds - update_overhead - update_per_byte * costs.weight_bytes(task))
            elif "microbatch" in e["args"]:   # a stash copy
                per["stash_s"].append(seconds - costs.stash_bytes(task) / swap_bandwidth)
            else:                             # a pack's weights (and a backward pack's gradients out)
                moved = 0.0 if e["name"].startswith("SO") and config.tasks[task].role == FORWARD \
                    else costs.weight_bytes(task)
                per["swap_s"].append(seconds - moved / swap_bandwidth)
        for side in measured:
            if profiled[side] > 0:
                per[f"{side}_ratio"].append(measured[side] / profiled[side])
        first = min(e["ts"] for e in actions)
        last = max(e["ts"] + e["dur"] for e in actions)
        busy = sum(e["dur"] for e in events if e["cat"] != "iteration")   # actions and waits
        gap = max(0.0, (last - first - busy) * 1e-6 / len(actions))
        per["action_s"].append(gap)           # after any action: FWD/BWD ones too
        per["compute_action_s"].append(gap)
        per["step_s"].append(((first - iteration["ts"]) + (iteration["ts"] + iteration["dur"] - last)) * 1e-6)
    return {name: max(0.0, statistics.median(values)) for name, values in sorted(per.items())}


def measure_harmony(model_overrides: Sequence[str], model_cfg: Any, sheet: dict,
                    micro_batches: Sequence[int] = (MICRO,), launches: int = LAUNCHES) -> dict[str, Any]:
    """The ``runtime.harmony`` section of a sheet profile entry: costs by process count (as strings,
    JSON keys), runs that failed under ``errors`` (e.g. a model harmony_pp refuses). ``sheet``: the
    calibration so far (swap bandwidth, optimizer fit, the all-busy slowdown).

    The layers' ratios compare each run with the model's layers timed alone by this process right
    before and right after it (``planner.calibrate.measure``; the geometric mean of the two), not with the
    sheet's profile, which another phase of a shared machine may have timed: so they hold
    harmony_pp's own slowdown (with two processes, their contention too), not the machine's
    change; the estimator applies them to those layers timed alone
    (``harmony_plan.harmony_profile``). Each process count is launched ``launches`` times (a
    launch as a whole runs 10-15% faster or slower than the next here) and each cost is the median
    over the launches. ``profile_alone``: the mean of the layer timings around the runs (at
    ``micro_batches``, the sheet's profile's sizes, and ``MICRO``). The sheet's own profile is
    timed with every calibrated process busy: with more processes than cores it holds their time
    slicing, by an amount that varies from one calibration to the next (4 processes on 2 cores: the
    layers alone took 0.49-0.69 of its times), which no matmul's slowdown recovers."""
    from planner.calibrate.measure import measure_profile

    optimizer = sheet["optimizer"]
    out: dict[str, Any] = {}
    errors = {}
    alone_timings = []
    sizes = sorted({*micro_batches, MICRO})
    with tempfile.TemporaryDirectory() as tmp:
        for processes in sorted({*PROCESSES, int(sheet.get("processes", 1))}):
            per_launch = []
            for _ in range(launches):
                before = measure_profile(model_cfg, sizes, "cpu", repeats=5)
                run = traced_harmony_run(model_overrides, processes, Path(tmp, f"harmony{processes}"))
                if "error" in run:
                    errors[str(processes)] = run["error"]
                    break
                after = measure_profile(model_cfg, sizes, "cpu", repeats=5)
                # the layers timed on both sides of the run: the geometric mean of the two ratios
                first, second = (harmony_overheads(run["trace"], alone, processes,
                                                   float(sheet["device"]["swap_bandwidth"]),
                                                   float(optimizer["seconds_per_parameter_byte"]),
                                                   float(optimizer["step_overhead_s"])) for alone in (before, after))
                per_launch.append({**first, **{k: math.sqrt(first[k] * second[k]) for k in _RATIOS if k in first}})
                alone_timings += [before.to_json(), after.to_json()]
            if per_launch and str(processes) not in errors:
                out[str(processes)] = {k: statistics.median(c[k] for c in per_launch) for k in per_launch[0]}
    if alone_timings:
        out["profile_alone"] = mean_profile(alone_timings)
    if errors:
        out["errors"] = errors
    return out


def print_harmony(section: dict) -> None:
    """``planner.calibrate.sheet``'s lines for the harmony runs."""
    for processes, c in sorted((k, v) for k, v in section.items() if k.isdigit()):
        print(f"  runtime (harmony_pp, {processes} process{'es' if processes != '1' else ''}): layers x"
              f"{c['forward_ratio']:.2f} the profile's in forward tasks, x{c['train_ratio']:.2f} with a graph; "
              f"{c['action_s'] * 1e6:.0f} us between actions, {c['swap_s'] * 1e6:.0f} us per weight swap, "
              f"{c['stash_s'] * 1e6:.0f} us per stash copy, {c['update_s'] * 1e6:.0f} us per update, "
              f"{c.get('message_s', 0.0) * 1e6:.0f} us per message, {c['step_s'] * 1e3:.2f} ms per step")
    for processes, reason in section.get("errors", {}).items():
        print(f"  runtime (harmony_pp, {processes} processes) not measured: {reason}")
