"""Planner fidelity on this machine: predicted vs measured step time and peak memory (RSS).

For each configuration of the grid (two GPT sizes and a plugin model, the example project's
``maskseq`` with its own data; pipeline, data and tensor parallelism; gpipe,
1f1b, interleaved, 2bw and pipedream schedules; several micro-batch sizes) the planner, pinned to
the configuration and planning with ``cluster=measured`` (this machine as ``python -m
planner.calibrate.sheet`` measured it), writes a plan; the launcher then trains that plan for real (two
processes over Gloo) and its summary gives the median step time after warm-up and each rank's peak
RSS. Predicted RSS = the plan's memory without the reserve: on a measured sheet the planner counts the
process itself (its calibrated base and what a traced run held beyond its model) and the model's
bytes. Then the planner runs free on each model and batch, and its first choice (run as well if
the grid lacks it) is compared with the measured fastest flush-schedule configuration.

The grid runs ``--repeats`` rounds (the order reversed every other round); each round is planned
from a calibration taken just before it, so a prediction and its run see the same phase of a shared
machine, and the medians of both over the rounds are kept. The other processes' share of the CPU
during each run and each calibration is recorded, since on a shared machine that is what moves the
measured times. Writes docs/bench_planner_fidelity.json and
its section of docs/benchmarks.md.

Run: .venv/bin/python -m scripts.bench.planner_fidelity [--steps 12] [--repeats 2] [--recalibrate]
     .venv/bin/python -m scripts.bench.planner_fidelity --quick   (3 configurations, nothing under docs/)
     .venv/bin/python -m scripts.bench.planner_fidelity --only pipedream --out-dir /tmp/x   (matching rows)
     .venv/bin/python -m scripts.bench.planner_fidelity --only maskseq --merge docs/bench_planner_fidelity.json
         (the matching rows measured again, the saved others kept, saved matching rows that were
         not measured again dropped; docs/ rewritten with all of them)
     .venv/bin/python -m scripts.bench.planner_fidelity --repredict docs/bench_planner_fidelity.json
         (the saved rows planned again from the work dir's saved calibrations: no runs)
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from pipedream.schedules import schedule_info
from scripts import ROOT
from scripts.bench.planner_fidelity_runs import (MODELS, PLUGIN_PATH, calibrate, launch_plan,  # noqa: F401
                                                 merge, model_and_data, summarise)
from scripts.bench.runtime_report import machine, replace_section

SECTION = "bench_planner_fidelity"
GLOBAL_BATCH = 32
TARGET_MEDIAN, TARGET_WORST, TARGET_CHOICE = 0.10, 0.25, 0.05


@dataclass(frozen=True)
class Config:
    model: str
    pp: int = 2
    dp: int = 1
    tp: int = 1
    micro: int = 4
    schedule: str = "1f1b"
    recompute: bool = False
    algorithm: str = "ptdp"

    @property
    def name(self) -> str:
        if self.algorithm == "pipedream":
            return f"{self.model} pipedream DP plan b={self.micro}"
        rec = " recompute" if self.recompute else ""
        return f"{self.model} p={self.pp} d={self.dp} t={self.tp} b={self.micro} {self.schedule}{rec}"

    @property
    def flush(self) -> bool:
        return not schedule_info(self.schedule).asynchronous

    def planner_overrides(self) -> list[str]:
        schedules = "[1f1b]" if self.schedule == "2bw" else f"[{self.schedule}]"
        out = [f"train.global_batch_size={GLOBAL_BATCH}", f"train.micro_batch_size={self.micro}",
               f"planner.algorithm={self.algorithm}", f"planner.schedules={schedules}",
               f"planner.recompute=[{str(self.recompute).lower()}]", "planner.simulate=false"]
        if self.algorithm != "pipedream":
            out += [f"planner.pp={self.pp}", f"planner.dp={self.dp}", f"planner.tp={self.tp}"]
        if self.tp > 1:
            out += [f"cluster.max_tp={self.tp}"]
        return out


def grid(quick: bool) -> list[Config]:
    a, b = "gpt_tiny", "gpt_tiny_h256"
    if quick:
        return [Config(a), Config(a, pp=1, dp=2, micro=8), Config(a, schedule="gpipe")]
    return [
        Config(a), Config(a, micro=8), Config(a, micro=2), Config(a, schedule="gpipe"),
        Config(a, schedule="interleaved"), Config(a, recompute=True), Config(a, pp=1, dp=2, micro=8),
        Config(a, pp=1, dp=2, micro=16), Config(a, schedule="2bw", algorithm="2bw"),
        Config(a, schedule="pipedream", algorithm="pipedream"), Config(a, pp=1, tp=2, micro=8),
        Config(b), Config(b, micro=8), Config(b, schedule="gpipe", micro=8), Config(b, pp=1, dp=2, micro=16),
        Config(b, schedule="2bw", algorithm="2bw", micro=8), Config("maskseq"),
    ]


def plan(cfg: Config, calibration: Path, out: Path) -> dict:
    from planner.__main__ import main as planner_main

    argv = list(MODELS[cfg.model]) + ["cluster=measured", f"cluster.calibration={calibration}", f"planner.out={out}"]
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        code = planner_main(argv + cfg.planner_overrides())
    if code != 0:
        raise SystemExit(f"planner refused {cfg.name}: {err.getvalue().strip()}")
    return json.loads(out.read_text())


def free_choice(model: str, calibration: Path, out: Path) -> dict:
    from planner.__main__ import main as planner_main

    argv = list(MODELS[model]) + ["cluster=measured", f"cluster.calibration={calibration}",
                                  f"train.global_batch_size={GLOBAL_BATCH}", "planner.simulate=false",
                                  f"planner.out={out}"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert planner_main(argv) == 0
    return json.loads(out.read_text())


PINNED_SEARCHES = ("ptdp", "2bw", "pipedream")   # the searches a grid configuration re-plans with


def config_of(model: str, plan_json: dict) -> Config:
    """The grid configuration of a plan: pinned to its degrees, micro-batch, schedule and recomputation
    and planned again by the search that chose it (PipeDream's DP chooses its stages and replicas
    itself; planned by PTD-P under the pins, a PipeDream plan would become another plan, and one
    whose micro-batch exceeds the batch per pipeline is refused)."""
    par, batch = plan_json["parallel"], plan_json["batch"]
    if batch["global"] != GLOBAL_BATCH:
        raise SystemExit(f"the planner's plan for {model} has global batch {batch['global']}, not the "
                         f"{GLOBAL_BATCH} it was asked for: it cannot be compared with the grid")
    algorithm = plan_json["planner"]["algorithm"]
    return Config(model, par["pp"], par["dp"], par["tp"], batch["micro"], plan_json["schedule"],
                  plan_json["recompute"] != "none", algorithm if algorithm in PINNED_SEARCHES else "ptdp")


def train(cfg: Config, plan_path: Path, run_dir: Path, steps: int) -> dict:
    """One real run of the plan; (median step s, peak RSS per rank, other processes' CPU share)."""
    out = launch_plan(model_and_data(cfg.model), plan_path, run_dir, steps, 29600, 900)
    if "error" in out:
        return {"error": out["error"]}
    summary = out.pop("summary")
    return {"step_s": summary["median_step_time_s"], "rss": max(r["peak_memory_bytes"]["rss"] for r in summary["ranks"]),
            **out, "load_average": os.getloadavg()[0]}


def selected(name: str, only: str) -> bool:
    """--only: the rows whose name holds one of its |-separated parts (all rows without it)."""
    return any(part in name for part in only.split("|"))


def error(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def run(args: argparse.Namespace) -> dict:
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    sheets = [work / f"calibration{r}.json" for r in range(args.repeats)]
    calibration = sheets[0]
    configs = grid(args.quick)
    models = {c.model for c in configs if selected(c.name, args.only)} or {c.model for c in configs}
    if args.recalibrate or not calibration.exists():
        calibration.unlink(missing_ok=True)
        calibrate(calibration, args.calibrate_repeats, models)
    choices = {}
    for model in sorted(models):
        choice_plan = free_choice(model, calibration, work / f"choice_{model}.json")
        choice = config_of(model, choice_plan)
        choices[model] = choice
        if choice not in configs:
            configs.append(choice)
    configs = [c for c in configs if selected(c.name, args.only)]
    plans: dict[Config, list[tuple[Path, dict]]] = {cfg: [] for cfg in configs}
    runs: dict[Config, list[dict]] = {cfg: [] for cfg in configs}
    for r in range(args.repeats):
        if r > 0:  # each round is predicted from a calibration taken just before it, in the same phase of the machine
            sheets[r].unlink(missing_ok=True)
            calibrate(sheets[r], args.calibrate_repeats, models)
        for i, cfg in enumerate(configs):
            path = work / f"plan{i}_round{r}.json"
            plans[cfg].append((path, plan(cfg, sheets[r], path)))
        order = configs if r % 2 == 0 else configs[::-1]  # both ends of the grid see early and late phases
        for cfg in order:
            runs[cfg].append(train(cfg, plans[cfg][r][0], work / "run", args.steps))
            last = runs[cfg][-1]
            print(f"round {r + 1}: {cfg.name}: " + (last["error"] if "error" in last else
                  f"{last['step_s'] * 1e3:.1f} ms, other load {(last['other_load'] or 0) * 100:.0f}%"), flush=True)
    sheet = json.loads(calibration.read_text())
    rows, failed = [], []
    for cfg in configs:
        plan_json = plans[cfg][0][1]
        predicted_runs = [p[1]["predicted"]["iteration_time_s"] for p in plans[cfg]]
        errors = [m["error"] for m in runs[cfg] if "error" in m]
        if errors:
            failed.append({"name": cfg.name, "error": errors[0]})
            continue
        pred = {**plan_json["predicted"], "iteration_time_s": statistics.median(predicted_runs)}
        # the planner's memory on a measured sheet: the process (base + runtime) + the model's bytes
        predicted_rss = pred["memory_bytes_per_device"] - plan_json["planner"]["memory_reserve_bytes"]
        measured = runs[cfg]
        step = statistics.median(m["step_s"] for m in measured)
        rss = statistics.median(m["rss"] for m in measured)
        rows.append({"config": asdict(cfg), "name": cfg.name, "profile": plan_json["planner"]["profile_source"],
                     "plan": {"parallel": plan_json["parallel"], "schedule": plan_json["schedule"],
                              "batch": plan_json["batch"], "stages": [s["layers"] for s in plan_json["stages"]]},
                     "predicted_step_s": pred["iteration_time_s"], "measured_step_s": step,
                     "step_error": error(pred["iteration_time_s"], step),
                     "measured_step_s_runs": [m["step_s"] for m in measured], "predicted_step_s_runs": predicted_runs,
                     "predicted_rss": predicted_rss, "measured_rss": rss,
                     "rss_error": error(predicted_rss, rss),
                     "other_load": [m["other_load"] for m in measured],
                     "load_average": [m["load_average"] for m in measured]})
    choice_rows = []
    for model, choice in choices.items():
        flush = [r for r in rows if r["config"]["model"] == model and Config(**r["config"]).flush]
        chosen = next((r for r in rows if Config(**r["config"]) == choice), None)
        if chosen is None or not flush:
            continue
        fastest = min(flush, key=lambda r: r["measured_step_s"])
        choice_rows.append({"model": model, "choice": chosen["name"], "choice_measured_s": chosen["measured_step_s"],
                            "fastest": fastest["name"], "fastest_measured_s": fastest["measured_step_s"],
                            "gap": chosen["measured_step_s"] / fastest["measured_step_s"] - 1})
    return {"machine": machine(), "steps": args.steps, "repeats": args.repeats, "global_batch": GLOBAL_BATCH,
            "calibration": {k: v for k, v in sheet.items() if k != "profiles"},
            "calibrations": [json.loads(c.read_text())["machine_load"] for c in sheets],
            "rows": rows, "choices": choice_rows, "failed": failed, "summary": summarise(rows, choice_rows)}


def repredict(data: dict, work: Path, only: str = "") -> list[dict]:
    """The saved rows re-planned from the saved calibrations of each round (nothing runs): what the
    planner predicts now for what was measured then."""
    out = []
    sheets = [work / f"calibration{r}.json" for r in range(data["repeats"])]
    for row in data["rows"]:
        if not selected(row["name"], only):
            continue
        cfg = Config(**row["config"])
        preds = [plan(cfg, sheet, work / f"repredict{r}.json")["predicted"]["iteration_time_s"]
                 for r, sheet in enumerate(sheets)]
        pred = statistics.median(preds)
        out.append({"name": row["name"], "measured_step_s": row["measured_step_s"],
                    "before_s": row["predicted_step_s"], "before_error": row["step_error"],
                    "now_s": pred, "now_error": error(pred, row["measured_step_s"])})
    return out


def repredict_markdown(rows: list[dict]) -> str:
    lines = ["| configuration | measured | predicted then | error | predicted now | error |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['measured_step_s'] * 1e3:.1f} ms | {r['before_s'] * 1e3:.1f} ms | "
              f"{r['before_error'] * 100:+.0f}% | {r['now_s'] * 1e3:.1f} ms | {r['now_error'] * 100:+.0f}% |" for r in rows]
    errors = [abs(r["now_error"]) for r in rows]
    return "\n".join(lines + ["", f"now: median |step error| {statistics.median(errors) * 100:.1f}%, worst "
                                   f"{max(errors) * 100:.1f}%"])


def markdown(data: dict) -> str:
    s, cal = data["summary"], data["calibration"]
    ok = lambda good: "met" if good else "**not met**"  # noqa: E731
    lines = [
        "## Planner fidelity: predicted vs measured on this machine", "",
        f"Written by `python -m scripts.bench.planner_fidelity` ({data['steps']} steps per run, median step time after "
        f"warm-up; {data['repeats']} rounds over the grid, each predicted from a calibration taken just before it, "
        f"medians of both kept; global batch "
        f"{data['global_batch']}; {data['machine']['cpu']}, {data['machine']['cores']} cores). The planner plans "
        f"with `cluster=measured`: this machine as `python -m planner.calibrate` measured it (first round) at "
        f"{calibration_text(cal)}." + "".join(" " + later_text(x) for x in data.get("later", [])), "",
        "| configuration | profile | predicted step (rounds) | measured step (rounds) | error | predicted RSS | measured RSS | "
        "error | other load |", "|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        runs = ", ".join(f"{t * 1e3:.0f}" for t in r["measured_step_s_runs"])
        preds = ", ".join(f"{t * 1e3:.0f}" for t in r.get("predicted_step_s_runs", []))
        load = "/".join(f"{(x or 0) * 100:.0f}%" for x in r["other_load"])
        lines.append(f"| {r['name']} | {r['profile']} | {r['predicted_step_s'] * 1e3:.1f} ms ({preds}) | "
                     f"{r['measured_step_s'] * 1e3:.1f} ms ({runs}) | {r['step_error'] * 100:+.0f}% | "
                     f"{r['predicted_rss'] / 2**20:.0f} MiB | {r['measured_rss'] / 2**20:.0f} MiB | "
                     f"{r['rss_error'] * 100:+.0f}% | {load} |")
    lines += [f"| {f['name']} | failed: {f['error']} | | | | | | | |" for f in data.get("failed", [])]
    lines += ["", "| model | planner's first choice | measured | measured fastest (flush schedules) | measured | gap |",
              "|---|---|---|---|---|---|"]
    for c in data["choices"]:
        lines.append(f"| {c['model']} | {c['choice']} | {c['choice_measured_s'] * 1e3:.1f} ms | {c['fastest']} | "
                     f"{c['fastest_measured_s'] * 1e3:.1f} ms | {c['gap'] * 100:+.1f}% |")
    spread = max(max(r["measured_step_s_runs"]) / min(r["measured_step_s_runs"]) for r in data["rows"])
    lines += ["", f"Targets: median |step error| {s['median_abs_step_error'] * 100:.1f}% (<= {TARGET_MEDIAN:.0%}: "
              f"{ok(s['median_abs_step_error'] <= TARGET_MEDIAN)}), worst {s['worst_abs_step_error'] * 100:.1f}% "
              f"(<= {TARGET_WORST:.0%}: {ok(s['worst_abs_step_error'] <= TARGET_WORST)}), first choice within "
              f"{s['worst_choice_gap'] * 100:.1f}% of the measured fastest (<= {TARGET_CHOICE:.0%}: "
              f"{ok(s['worst_choice_gap'] <= TARGET_CHOICE)}); median |RSS error| {s['median_abs_rss_error'] * 100:.1f}%."
              f" Other processes used a median {(s['median_other_load'] or 0) * 100:.0f}% of the machine's CPU "
              f"during the runs: the calibration and the runs share the machine with them, so both move with its "
              f"load.", "",
              limits(data, spread)]
    return "\n".join(lines)


def calibration_text(cal: dict) -> str:
    return (f"{cal['measured_at']} ({cal['device']['flops_fp32'] / 1e9:.1f} GFLOP/s per process with all busy, "
            f"layer times x{cal['compute_slowdown']:.2f} for contention, p2p {cal['p2p']['latency_s'] * 1e6:.0f} us + "
            f"{cal['p2p']['bandwidth'] / 1e9:.2f} GB/s, all-reduce step {cal['allreduce']['latency_s'] * 1e6:.0f} us, "
            f"optimizer {cal['optimizer']['seconds_per_parameter_byte'] * 1e12:.0f} ps per parameter byte, process base "
            f"{cal['process_base_bytes'] / 2**20:.0f} MiB; other processes used "
            + (f"{(cal['machine_load']['other_cpu_share'] or 0) * 100:.0f}% of the CPU while it measured)"
               if cal["machine_load"].get("workers_excluded") else
               "an unknown share of the CPU while it measured: this sheet counted its own workers as others)"))


def later_text(later: dict) -> str:
    """Rows measured after the rest (``--merge``): when, from which calibration, under what load."""
    load = later["summary"].get("median_other_load")
    return (f"The rows {', '.join(later['rows'])} were measured later ({later['repeats']} rounds of {later['steps']} "
            f"steps), each round planned from its own calibration; the first taken at "
            f"{calibration_text(later['calibration'])}; other processes used a median "
            f"{(load or 0) * 100:.0f}% of the CPU during their runs.")


def limits(data: dict, spread: float) -> str:
    """What limits the fidelity, from the rows: the noise between rounds, which way the step
    predictions lean and why, the worst row, and the RSS gap."""
    errors = sorted(r["step_error"] for r in data["rows"])
    median = errors[len(errors) // 2]
    worst = max(data["rows"], key=lambda r: abs(r["step_error"]))
    why = ("a step also spends time the calibrated per-layer model does not count: per-action work in "
           "Python, waits for messages and the synchronisation at the flush" if median < 0 else
           "the layer times are measured with every process computing all the time and each layer's forward and "
           "backward as a separate autograd call, while in training a process also waits and runs a stage's "
           "layers in one backward")
    return (f"What limits it: a configuration measured twice differs by up to {spread:.1f}x between rounds (the "
            f"rounds columns), because the machine's other processes come and go and the calibration is a snapshot "
            f"of one such phase. The step predictions lean {'low' if median < 0 else 'high'} (median signed error "
            f"{median * 100:+.0f}%): {why}. The worst row, {worst['name']} ({worst['step_error'] * 100:+.0f}%), "
            f"plans from the {worst['profile']} profile. The RSS prediction counts the process as the calibration's "
            f"traced runs measured it (interpreter, torch, Hydra, data, Gloo and allocator buffers beyond the model); "
            f"what the model holds beyond that moves with the allocator. The first choice is judged among the flush "
            f"schedules.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--calibrate-repeats", type=int, default=7)
    parser.add_argument("--recalibrate", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--work-dir", default=str(ROOT / "runs" / "bench_planner_fidelity"))
    parser.add_argument("--out-dir", default=None, help="default docs/ (none with --quick)")
    parser.add_argument("--report-only", metavar="JSON", help="rewrite the Markdown from a saved JSON, measure nothing")
    parser.add_argument("--only", default="", metavar="TEXT", help="only the configurations whose name holds TEXT (alternatives separated by |)")
    parser.add_argument("--merge", metavar="JSON", help="put the rows just measured (or --report-only's) into this "
                        "saved result in place of those of the same name, keeping the others; writes the merged result")
    parser.add_argument("--repredict", metavar="JSON", help="re-plan a saved JSON's rows from the work dir's "
                        "calibrations and print predicted then vs now against what was measured; runs nothing")
    args = parser.parse_args()
    if args.repredict:
        print(repredict_markdown(repredict(json.loads(Path(args.repredict).read_text()), Path(args.work_dir), args.only)))
        return 0
    data = json.loads(Path(args.report_only).read_text()) if args.report_only else run(args)
    if args.merge:
        data = merge(json.loads(Path(args.merge).read_text()), data, lambda name: bool(args.only) and selected(name, args.only))
    text = markdown(data)
    print(text)
    out = Path(args.out_dir) if args.out_dir else (None if args.quick else ROOT / "docs")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_planner_fidelity.json").write_text(json.dumps(data, indent=1) + "\n")
        replace_section(out / "benchmarks.md", SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
