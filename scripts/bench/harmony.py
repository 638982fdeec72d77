"""Harmony's runtime estimator against real harmony_pp runs on this machine, and the search time.

For each configuration of the grid (1, 2 and 4 devices; different forward and backward pack
splits; whole and smaller task groups; the whole model as one jit pack, i.e. no recomputation) the
estimator (``planner.harmony.search.evaluate``: the runtime's own action lists, timed with the
per-layer profile, the swap and point-to-point bandwidths, the optimizer step and the runtime's own
costs per action kind, per message and per step and its layers' time over the profile's (traced harmony_pp runs on 1
and 2 processes, ``planner.calibrate.harmony``) that ``python -m planner.calibrate`` measured here with as many
processes as the configuration has devices) predicts
the iteration time (by default from a calibration taken just before the row's run, so both see the
same phase of a shared machine); the launcher then trains a plan file of exactly that configuration
(``parallel.plan=``, processes over Gloo, the "device" tier in RAM) and its summary gives the median
step time after warm-up. The device budget of each run is the estimator's peak of managed bytes
plus a quarter, below the model's weights, gradients and optimizer state where the packs allow.
The planner's own choice (``planner.algorithm=harmony``) for 2 devices runs as one more row.
Separately, the search is timed on analytic GPT profiles of 100+ layers (no runs).

Writes docs/bench_harmony.json, docs/bench_harmony.md and its section of docs/benchmarks.md.

Run: .venv/bin/python -m scripts.bench.harmony [--steps 8] [--quick] [--report-only docs/bench_harmony.json]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from scripts import ROOT
from scripts.bench.runtime_report import machine, write_report

SECTION = "bench_harmony"
GLOBAL_BATCH = 8
# 6 blocks: 8 pipeline layers (embedding, blocks, head); untied so packs own their weights
MODEL = ("model=gpt_tiny", "model.num_layers=6", "model.tie_embeddings=false")
LAYERS = 8
TARGET = 0.15


@dataclass(frozen=True)
class Row:
    devices: int
    micro: int
    forward: tuple[int, ...]     # layers per forward pack (the last is the jit pack)
    backward: tuple[int, ...]    # layers per backward pack (the same last pack)
    forward_group: int = 0       # micro-batches per task group; 0: all
    backward_group: int = 0

    @property
    def microbatches(self) -> int:
        return GLOBAL_BATCH // self.micro

    @property
    def name(self) -> str:
        groups = "" if not (self.forward_group or self.backward_group) else \
            f" U_F={self.forward_group or self.microbatches} U_B={self.backward_group or self.microbatches}"
        jit = " (all jit, no recompute)" if len(self.backward) == 1 else ""
        return (f"N={self.devices} b={self.micro} P_F={list(self.forward)} P_B={list(self.backward)}"
                f"{groups}{jit}")


def grid(quick: bool) -> list[Row]:
    rows = [
        Row(1, 2, (4, 4), (2, 2, 4)),
        Row(1, 4, (8,), (8,)),
        Row(2, 2, (3, 3, 2), (2, 2, 2, 2)),
        Row(2, 2, (3, 3, 2), (2, 2, 2, 2), 2, 2),
        Row(2, 4, (6, 2), (1, 1, 1, 1, 1, 1, 2)),
        Row(2, 1, (2, 2, 2, 2), (4, 2, 2)),
        Row(4, 2, (2, 2, 2, 2), (2, 2, 2, 2)),
        Row(4, 2, (1, 1, 1, 1, 1, 1, 2), (1, 1, 1, 1, 1, 1, 2), 1, 1),
        Row(1, 1, (2, 2, 2, 2), (1, 1, 1, 1, 1, 1, 2), 4, 2),
    ]
    return rows[2:4] + rows[6:7] if quick else rows


def packs(sizes) -> tuple[tuple[int, int], ...]:
    out, first = [], 0
    for size in sizes:
        out.append((first, first + size))
        first += size
    return tuple(out)


def planned(row: Row):
    from planner.harmony.tasks import PlannedConfig

    m = row.microbatches
    forward, backward = packs(row.forward), packs(row.backward)
    return PlannedConfig(row.micro, row.forward_group or m, forward[:-1], row.backward_group or m, backward,
                         row.devices, GLOBAL_BATCH)


def calibrate(path: Path, devices: int, repeats: int) -> dict:
    if not path.exists():
        cmd = [sys.executable, "-m", "planner.calibrate", *MODEL, f"cluster.devices_per_node={max(devices, 2)}",
               f"planner.calibration_out={path}", f"planner.calibrate_repeats={repeats}",
               "planner.calibrate_micro_batches=[1,2,4,8]"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"calibration with {devices} processes failed: {proc.stderr.strip()}")
        print(proc.stdout.strip(), flush=True)
    return json.loads(path.read_text())


def inputs_for(sheet_path: Path, devices: int):
    """The planner's inputs on the measured sheet: the measured profile, the links, the host update."""
    from planner.config import compose, inputs_from_config

    cfg = compose([*MODEL, "cluster=measured", f"cluster.calibration={sheet_path}",
                   f"cluster.devices_per_node={max(devices, 2)}", f"train.global_batch_size={GLOBAL_BATCH}"])
    return inputs_from_config(cfg)


def predict(row: Row, sheet_path: Path) -> dict:
    from planner.harmony.plan import harmony_links, harmony_overheads, harmony_profile, host_update
    from planner.harmony.search import evaluate

    inputs = inputs_for(sheet_path, row.devices)
    if inputs.profile.source != "measured":
        raise SystemExit(f"{sheet_path} has no measured profile of the benchmark model")
    host, _ = host_update(inputs)
    est = evaluate(harmony_profile(inputs, row.devices), planned(row), harmony_links(inputs, row.devices), host,
                   harmony_overheads(inputs, row.devices))
    weights = float(inputs.profile.arrays["parameter_bytes"].sum())
    state = weights + float(inputs.profile.arrays["optimizer_bytes"].sum())
    return {"iteration_s": est.iteration_s, "peak_managed_bytes": max(est.peak_managed_bytes),
            "peak_bytes": max(est.peak_bytes), "weights_in_bytes": est.weights_in_bytes,
            "gradients_out_bytes": est.gradients_out_bytes, "weight_bytes": weights,
            "weights_and_state_bytes": weights + state}


def write_plan(row: Row, budget: float, path: Path) -> None:
    from pipedream.config.plan_file import Batch, ClusterInfo, Harmony, ModelInfo, Parallel, Plan, Predicted

    cfg = planned(row)
    plan = Plan(ModelInfo("gpt_tiny", LAYERS, 0), ClusterInfo("local_cpu", row.devices, row.devices),
                Parallel(row.devices, 1, 1, 1), "harmony_pp", Batch(GLOBAL_BATCH, row.micro, row.microbatches),
                "full", (), Predicted(0.0, 0.0, 0.0, 0.0, 0.0), precision="fp32",
                harmony=Harmony(cfg.forward_packs, cfg.packs_b, cfg.u_f, cfg.u_b, row.devices, budget))
    plan.save(path)


def train(plan_path: Path, run_dir: Path, steps: int, repeats: int) -> dict:
    """``repeats`` launches of the plan: the median of their median step times (one launch's steps
    agree with each other far better than two launches do: 53-70 ms for one configuration here)."""
    from scripts.bench.planner_fidelity_runs import launch_plan

    runs = []
    for _ in range(repeats):
        # Harmony updates each pack right after its backward: no global gradient norm to clip with
        out = launch_plan([*MODEL, "train.grad_clip=0"], plan_path, run_dir, steps, 29300, 1200)
        if "error" in out:
            return out
        runs.append(out)
    launches = [r["summary"]["median_step_time_s"] for r in runs]
    return {"step_s": statistics.median(launches), "launch_step_s": launches,
            "other_load": max((r.get("other_load") or 0.0) for r in runs),
            "wall_s": sum(r["wall_s"] for r in runs),
            "ranks": runs[-1]["summary"].get("ranks", [])}   # the counters are the same in every launch


def planner_choice(sheet_path: Path, out: Path, budget: float) -> tuple[Row, float]:
    """The planner's own harmony plan for 2 devices on the measured sheet, as a grid row."""
    from planner.__main__ import main as planner_main

    argv = [*MODEL, "cluster=measured", f"cluster.calibration={sheet_path}", "cluster.devices_per_node=2",
            f"train.global_batch_size={GLOBAL_BATCH}", "planner.algorithm=harmony", "planner.max_micro_batch=4",
            f"planner.device_budget_bytes={int(budget)}", f"planner.out={out}"]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        if planner_main(argv) != 0:
            raise SystemExit(f"planner refused: {err.getvalue().strip()}")
    plan = json.loads(out.read_text())
    h = plan["harmony"]
    m = plan["batch"]["num_microbatches"]
    row = Row(h["devices"], plan["batch"]["micro"], tuple(e - s for s, e in h["forward_packs"]),
              tuple(e - s for s, e in h["backward_packs"]),
              0 if h["forward_group"] == m else h["forward_group"], 0 if h["backward_group"] == m else h["backward_group"])
    return row, plan["planner"]["search_seconds"]


def search_times() -> list[dict]:
    """The search on analytic GPT profiles of 100+ layers on one 8-GPU server, budget |W| / 4."""
    from planner.config import compose, inputs_from_config
    from planner.harmony.plan import harmony_links
    from planner.harmony.search import harmony_search

    out = []
    for blocks, batch in ((120, 64), (250, 64)):
        inputs = inputs_from_config(compose(["model=gpt_1.7b", f"model.num_layers={blocks}", "cluster=h200_x8",
                                             "cluster.nodes=1", f"train.global_batch_size={batch}"]))
        budget = float(inputs.profile.arrays["parameter_bytes"].sum()) / 4
        start = time.perf_counter()
        result = harmony_search(inputs.profile, harmony_links(inputs, 8), 8, batch, budget, 32)
        out.append({"model": f"gpt_1.7b with {blocks} blocks", "layers": inputs.profile.num_layers,
                    "minibatch": batch, "devices": 8, "budget_bytes": budget, "considered": result.considered,
                    "seconds": time.perf_counter() - start, "best": result.best.config.brief()})
    return out


def run(args: argparse.Namespace) -> dict:
    from planner.harmony.plan import cpu_slots

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows = grid(args.quick)
    chosen = set(range(len(rows) + 1)) if args.rows is None else {int(r) for r in args.rows.split(",")}
    results, first_sheet = [], None
    for i, row in enumerate(rows + [None]):
        if i not in chosen:
            continue
        devices = 2 if row is None else row.devices
        sheet_path = work / (f"calibration_{max(devices, 2)}.json" if args.calibrate_once else f"calibration_row{i}.json")
        if not args.calibrate_once:   # each row predicted from a calibration taken just before its run
            sheet_path.unlink(missing_ok=True)
        sheet = calibrate(sheet_path, devices, args.calibrate_repeats)
        first_sheet = first_sheet or sheet
        if row is None:   # the planner's choice, at the budget of the 2-device rows
            budget = min(r["budget_bytes"] for r in results if r["devices"] == 2) if results else 4e6
            row, seconds = planner_choice(sheet_path, work / "choice.json", budget)
            label = "planner's choice: "
        else:
            label, seconds = "", None
        pred = predict(row, sheet_path)
        budget = pred["peak_managed_bytes"] * 1.25
        plan_path = work / f"plan{i}.json"
        write_plan(row, budget, plan_path)
        measured = train(plan_path, work / "run", args.steps, args.repeats)
        result = {"name": label + row.name, "row": asdict(row), "devices": row.devices, "budget_bytes": budget,
                  "predicted": pred, **measured,
                  "calibration": {"flops_fp32": sheet["device"]["flops_fp32"], "compute_slots": cpu_slots(sheet),
                                  "other_cpu_share": sheet["machine_load"]["other_cpu_share"]}}
        if seconds is not None:
            result["search_seconds"] = seconds
        if "step_s" in measured:
            result["step_error"] = pred["iteration_s"] / measured["step_s"] - 1
        results.append(result)
        print(f"{result['name']}: predicted {pred['iteration_s'] * 1e3:.1f} ms, " +
              (f"failed: {measured['error']}" if "step_s" not in measured else
               f"measured {measured['step_s'] * 1e3:.1f} ms ({result['step_error'] * 100:+.0f}%)"), flush=True)
    return {"machine": machine(), "steps": args.steps, "repeats": args.repeats, "global_batch": GLOBAL_BATCH, "model": list(MODEL),
            "calibration": {k: v for k, v in first_sheet.items() if k != "profiles"}, "rows": results,
            "calibrate_once": args.calibrate_once, "search": search_times(), "wall_s": time.perf_counter() - started,
            "command": " ".join([".venv/bin/python -m scripts.bench.harmony", *sys.argv[1:]])}


def markdown(data: dict) -> str:
    ok = [r for r in data["rows"] if "step_s" in r]
    failed = [r for r in data["rows"] if "step_s" not in r]
    errors = [abs(r["step_error"]) for r in ok]
    within = sum(e <= TARGET for e in errors)
    cal = data["calibration"]
    lines = [
        "## Harmony: the runtime estimator against real runs, and the search time", "",
        f"Written by `{data.get('command', 'python -m scripts.bench.harmony')}` in {data.get('wall_s', 0) / 60:.0f} min "
        f"({data.get('repeats', 1)} launch(es) of {data['steps']} steps per row, the median of their median step "
        f"times after warm-up; global batch {data['global_batch']}; "
        f"`{' '.join(data['model'])}`; {data['machine']['cpu']}, {data['machine']['cores']} cores). Each row's "
        f"prediction is `planner.harmony.search.evaluate`: the runtime's harmony_pp action lists simulated with the "
        f"measured per-layer profile, swap bandwidth ({cal['device'].get('swap_bandwidth', cal['device']['memory_bandwidth'] / 2) / 1e9:.2f} GB/s), "
        f"point-to-point {cal['p2p']['latency_s'] * 1e6:.0f} us + {cal['p2p']['bandwidth'] / 1e9:.2f} GB/s and optimizer "
        f"step ({cal['optimizer']['seconds_per_parameter_byte'] * 1e12:.0f} ps per parameter byte) and the runtime's "
        f"own costs per action kind (weight swap, stash copy, update), message and step and its layers' time over the "
        f"same layers timed alone around those runs (traced harmony_pp runs on 1 and 2 processes and on the calibration's own process count, "
        f"`planner.calibrate.harmony`; a row takes those of the most processes up to its devices) of a "
        f"calibration with as many processes as devices (2 for one device; with 4 processes on 2 cores each "
        f"process's GFLOP/s below is about half), "
        + ("one per device count" if data.get("calibrate_once") else "taken just before each row's run (the first "
           "one's numbers here)")
        + "; copies are synchronous on CPU, and the processes share the compute slots the calibration measured. "
        "Each run's `memory.device_budget_bytes` is the predicted peak of managed bytes + 25%.", "",
        "| configuration | predicted | measured | error | budget | weights + grads + optimizer state | "
        "calibration: GFLOP/s per process, slots, others' CPU | others' CPU in the run |",
        "|---|---|---|---|---|---|---|---|"]
    for r in ok:
        p = r["predicted"]
        c = r.get("calibration") or {}
        cal_text = (f"{c['flops_fp32'] / 1e9:.1f}, {c['compute_slots']}, {(c['other_cpu_share'] or 0) * 100:.0f}%"
                    if c else "")
        lines.append(f"| {r['name']} | {p['iteration_s'] * 1e3:.1f} ms | {r['step_s'] * 1e3:.1f} ms | "
                     f"{r['step_error'] * 100:+.0f}% | {r['budget_bytes'] / 2**20:.2f} MiB | "
                     f"{(p['weights_and_state_bytes']) / 2**20:.2f} MiB | {cal_text} | "
                     f"{(r.get('other_load') or 0) * 100:.0f}% |")
    lines += [f"| {r['name']} | {r['predicted']['iteration_s'] * 1e3:.1f} ms | failed: {r['error']} | | | | | |"
              for r in failed]
    if errors:
        lines += ["", f"Target: predicted within {TARGET:.0%} of measured for at least 8 configurations: "
                      f"{within} of {len(errors)} are (median |error| {statistics.median(errors) * 100:.1f}%, worst "
                      f"{max(errors) * 100:.1f}%): {'met' if within >= 8 else '**not met**'}."]
    cals = [r["calibration"] for r in ok if r.get("calibration")]
    if errors and cals:
        signed = sorted(r["step_error"] for r in ok)
        flops = [c["flops_fp32"] / 1e9 for c in cals]
        others = [(c["other_cpu_share"] or 0) * 100 for c in cals]
        lines += ["", f"What limits it here: the calibrations before the rows measured {min(flops):.0f} to "
                      f"{max(flops):.0f} GFLOP/s per process while other processes used {min(others):.0f}% to "
                      f"{max(others):.0f}% of the CPU, and each run meets the machine in another phase; the "
                      f"predictions lean {'low' if signed[len(signed) // 2] < 0 else 'high'} (median signed error "
                      f"{signed[len(signed) // 2] * 100:+.0f}%). A calibration taken while other processes load the "
                      f"machine times the layers and the runtime's own costs slower than the run may meet them "
                      f"(or faster), and one traced harmony_pp configuration per process count sets the layers' "
                      f"ratio to the profile for every configuration. Traces show what the estimator does not "
                      f"model: on Gloo a receive (even posting it) now and then stalls for milliseconds, more often "
                      f"with several groups per task."]
    lines += ["", "Search time (`planner.harmony.search.harmony_search`, analytic profiles, 8 x H200 with "
                  "budget |W| / 4, micro-batches up to 32):", "", "| model | layers | mini-batch | configurations | "
                  "seconds | best |", "|---|---|---|---|---|---|"]
    for s in data["search"]:
        best = s["best"].replace("|", "\\|")   # older reports wrote |P_F|
        lines.append(f"| {s['model']} | {s['layers']} | {s['minibatch']} | {s['considered']} | {s['seconds']:.2f} | "
                     f"{best} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="steps per run; the median after warm-up is kept (a step here varies by +-25%%)")
    parser.add_argument("--repeats", type=int, default=2, help="launches per row; the median of their medians is kept")
    parser.add_argument("--calibrate-repeats", type=int, default=3)
    parser.add_argument("--calibrate-once", action="store_true",
                        help="one calibration per device count (kept in --work-dir) instead of one before each row")
    parser.add_argument("--quick", action="store_true", help="3 configurations and the planner's choice")
    parser.add_argument("--rows", help="only these rows of the grid, e.g. 2,3 (the planner's choice is the last index)")
    parser.add_argument("--work-dir", default=str(ROOT / "runs" / "bench_harmony"))
    parser.add_argument("--out", default=str(ROOT / "docs" / "bench_harmony"))
    parser.add_argument("--report-only", metavar="JSON", help="rewrite the Markdown from a saved JSON, measure nothing")
    args = parser.parse_args()
    data = json.loads(Path(args.report_only).read_text()) if args.report_only else run(args)
    write_report(Path(args.out), data, markdown(data), SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
