"""Simulated traces for docs/cluster.md: Gavel's heterogeneity-aware policies against their agnostic
baselines (and the cost policies against each other) on the paper's 36 V100 + 36 P100 + 36 K80
fleet, with throughputs from the planner, and the same policy with and without space sharing.
Writes docs/cluster_sim.json, docs/img/cluster_*.png and the tables between the markers in
docs/cluster.md.
Run: .venv/bin/python -m scripts.docs.cluster [--quick] [--only NAME ...] [--sections-only]
(--quick: fewer jobs, a smoke run; --only: re-run those experiments, keep the rest from the JSON)
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import time

from planner.cluster.__main__ import colocation_for, load_setup, main as cluster_main, simulate_both
from planner.cluster.fleet import Job
from planner.cluster.report import plot_results
from planner.cluster.simulator import simulate
from planner.config import compose
from scripts import ROOT

DOC = ROOT / "docs" / "cluster.md"
SIM_JSON = ROOT / "docs" / "cluster_sim.json"
# (name, policy, overrides, what the dissertation reports for the same comparison)
EXPERIMENTS = [
    ("las_single", "max_min_fairness", ["trace.jobs=240", "trace.rate_per_hour=3"],
     "LAS, continuous-single: 3.5x lower average JCT at high load (Fig. 5.9); 3.7 h vs 5.4 h on the "
     "physical-size trace (Table 5.3)"),
    ("las_single_high", "max_min_fairness", ["trace.jobs=240", "trace.rate_per_hour=6"],
     "the same at twice the arrival rate (a shorter trace: 40 h of arrivals)"),
    ("las_single_ideal", "max_min_fairness", ["trace.jobs=240", "trace.rate_per_hour=3", "mechanism=ideal"],
     "the ideal mechanism (exactly X): Gavel's 6-minute rounds behave almost identically (Fig. 5.15b)"),
    ("las_multi", "max_min_fairness", ["trace.jobs=160", "trace.rate_per_hour=1", "trace.multi_gpu=true"],
     "LAS, continuous-multiple: 2.2x lower average JCT (Fig. 5.10)"),
    ("ftf_multi", "finish_time_fairness", ["trace.jobs=160", "trace.rate_per_hour=1", "trace.multi_gpu=true"],
     "finish-time fairness, continuous-multiple: 3x lower average JCT, 2.8x better FTF (Fig. 5.11)"),
    ("las_water_single", "max_min_fairness_water_filling", ["trace.jobs=240", "trace.rate_per_hour=3"],
     "water filling (ch. 5.4.3): the same minimum as LAS, the spare capacity to the lowest shares; the "
     "dissertation reports no JCT for it alone"),
    ("sjf_single", "sjf", ["trace.jobs=240", "trace.rate_per_hour=3"],
     "shortest job first (Table 5.1); no figure in the dissertation"),
    ("fifo_single", "fifo", ["trace.jobs=240", "trace.rate_per_hour=3"],
     "FIFO: 2.7x lower average JCT at high load, without space sharing (ch. 5.7.3)"),
    ("makespan_static", "makespan", ["trace.jobs=100", "trace.rate_per_hour=0", "trace.window=[0,1]"],
     "makespan, static trace: 2.5x lower than FIFO, 1.4x lower than Gandiva (ch. 5.7.3); 17.6 h vs 22.1 h "
     "(Table 5.3, 100 jobs)"),
]
SPACE = ("space_sharing", "max_min_fairness",
         ["trace.jobs=120", "trace.rate_per_hour=3", "space_sharing=true", "colocation_factor=0.6"],
         "space sharing lowers LAS's and FIFO's average JCT further at high load (FIFO: 2.7x without, 3.8x with, "
         "continuous-single; ch. 5.7.3), with measured pair throughputs")
COST = ("cost", ["max_throughput", "min_cost", "min_cost_slo"],
        ["trace.jobs=120", "trace.rate_per_hour=1", "trace.slo_factors=[1.2,2,10]",
         "trace.mix=[{model: resnet50, batch: 32},{model: gpt_small, batch: 16}]"],
        "500 jobs of ResNet-50 and A3C: min cost 1.4x cheaper than max throughput with ~35% of SLOs "
        "missed; min cost with SLOs misses none at 1.2x cheaper (ch. 5.7.3)")


def quick(overrides: list[str]) -> list[str]:
    return [o.replace("trace.jobs=240", "trace.jobs=40").replace("trace.jobs=160", "trace.jobs=30")
            .replace("trace.jobs=120", "trace.jobs=30").replace("trace.jobs=100", "trace.jobs=20") for o in overrides]


def run_pair(name: str, policy: str, overrides: list[str], paper: str) -> dict:
    cfg = compose([f"policy={policy}", "mode=simulate", *overrides], config_name="gavel")
    fleet, table, jobs = load_setup(cfg)
    results, rows, window = simulate_both(cfg, fleet, table, jobs, policy)
    plot_results(results, window, str(ROOT / "docs" / "img" / f"cluster_{name}.png"),
                 f"{policy}, {len(jobs)} jobs on {fleet.name}")
    return {"name": name, "policy": policy, "overrides": overrides, "paper": paper, "results": rows}


def run_space(overrides: list[str]) -> dict:
    """The aware policy on one trace with and without space sharing (the agnostic one never shares)."""
    name, policy, _, paper = SPACE
    cfg = compose([f"policy={policy}", "mode=simulate", *overrides], config_name="gavel")
    fleet, table, jobs = load_setup(cfg)
    T = table.matrix(jobs)
    lo, hi = (float(f) for f in cfg.trace.window)
    window = (int(lo * len(jobs)), int(hi * len(jobs)))
    args = (float(cfg.round_minutes) * 60, float(cfg.resolve_minutes) * 60, str(cfg.mechanism), float(cfg.max_hours))
    results = [simulate(jobs, T, fleet, policy, "aware", *args, colocation)
               for colocation in (None, colocation_for(cfg, jobs, T, fleet, table))]
    plot_results(results, window, str(ROOT / "docs" / "img" / f"cluster_{name}.png"),
                 f"{policy} without / with space sharing, {len(jobs)} jobs on {fleet.name}")
    rows = [dict(r.metrics(jobs, window), space_sharing=shared) for r, shared in zip(results, (False, True))]
    return {"name": name, "policy": policy, "overrides": overrides, "paper": paper, "results": rows}


def run_cost(overrides: list[str]) -> dict:
    name, policies, _, paper = COST
    cfg = compose(["mode=simulate", *overrides], config_name="gavel")
    fleet, table, jobs = load_setup(cfg)
    T = table.matrix(jobs)
    window = (0, len(jobs))
    results = [simulate(jobs, T, fleet, p, "aware", float(cfg.round_minutes) * 60, float(cfg.resolve_minutes) * 60,
                        str(cfg.mechanism), float(cfg.max_hours)) for p in policies]
    plot_results(results, window, str(ROOT / "docs" / "img" / f"cluster_{name}.png"),
                 f"cost policies, {len(jobs)} jobs on {fleet.name}")
    return {"name": name, "policy": "/".join(policies), "overrides": overrides, "paper": paper,
            "results": [r.metrics(jobs, window) for r in results]}


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def markdown(experiments: list[dict]) -> str:
    lines = ["| experiment | trace | aware avg JCT h | agnostic avg JCT h | JCT gain | aware makespan h | "
             "agnostic makespan h | makespan gain | the dissertation |", "|---|---|---|---|---|---|---|---|---|"]
    for e in experiments:
        if e["name"] in ("cost", "space_sharing"):
            continue
        aware, agnostic = e["results"]
        trace = ", ".join(o.split("=", 1)[0].replace("trace.", "") + "=" + o.split("=", 1)[1] for o in e["overrides"])
        fmt = lambda v: f"{v:.2f}" if v is not None else "unfinished"  # noqa: E731
        lines.append(f"| {e['policy']} | {trace} | {fmt(aware['avg_jct_h'])} | {fmt(agnostic['avg_jct_h'])} | "
                     f"{ratio(agnostic['avg_jct_h'], aware['avg_jct_h'])} | {fmt(aware['makespan_h'])} | "
                     f"{fmt(agnostic['makespan_h'])} | {ratio(agnostic['makespan_h'], aware['makespan_h'])} | {e['paper']} |")
    space = next((e for e in experiments if e["name"] == "space_sharing"), None)
    if space:
        alone, shared = space["results"]
        trace = ", ".join(o.split("=", 1)[0].replace("trace.", "") + "=" + o.split("=", 1)[1] for o in space["overrides"])
        lines += ["", "| space sharing: policy | trace | avg JCT h alone | avg JCT h with pairs | JCT gain | "
                      "makespan h alone | makespan h with pairs | the dissertation |", "|---|---|---|---|---|---|---|---|"]
        lines.append(f"| {space['policy']} (aware) | {trace} | {alone['avg_jct_h']:.2f} | {shared['avg_jct_h']:.2f} | "
                     f"{ratio(alone['avg_jct_h'], shared['avg_jct_h'])} | {alone['makespan_h']:.2f} | "
                     f"{shared['makespan_h']:.2f} | {space['paper']} |")
    cost = next((e for e in experiments if e["name"] == "cost"), None)
    if cost:
        base = cost["results"][0]["cost_dollars"]
        lines += ["", "| cost experiment: policy | total cost $ | cheaper than max_throughput | SLOs missed | "
                      "avg JCT h | the dissertation |", "|---|---|---|---|---|---|"]
        for r in cost["results"]:
            lines.append(f"| {r['policy']} | {r['cost_dollars']:.0f} | {base / r['cost_dollars']:.2f}x | "
                         f"{r['slo_violations']} of {r['slo_jobs']} | {r['avg_jct_h']:.2f} | "
                         f"{cost['paper'] if r is cost['results'][0] else ''} |")
    return "\n".join(lines)


# Table 6.1 of the dissertation: throughput speed-up over a K80 (P100, V100), measured
TABLE_6_1 = [("Transformer", 3.3, 3.3), ("A3C", 1.2, 2.2), ("CycleGAN", 4.5, 9.3), ("ResNet-18", 4.0, 6.8),
             ("ResNet-50", 3.7, 9.6)]
EXAMPLE = ["jobs=docs/cluster_jobs.yaml", "fleet=gavel_physical", "policy=max_min_fairness"]
WATER_EXAMPLE = ["jobs=docs/cluster_jobs.yaml", "fleet=gavel_physical", "policy=max_min_fairness_water_filling"]
SMALL_FLEET = ["fleet=gavel_physical", "fleet.types.v100.count=2", "fleet.types.p100.count=2", "fleet.types.k80.count=2"]
HIERARCHICAL_EXAMPLES = {within: ["jobs=docs/cluster_jobs_entities.yaml", *SMALL_FLEET, "policy=hierarchical",
                                  f"within={within}"] for within in ("fairness", "fifo")}


def throughput_section() -> str:
    """T for the trace mix on one GPU of each type, with the speed-ups Table 6.1 measured."""
    cfg = compose([], config_name="gavel")
    fleet, table, _ = load_setup(compose(["trace.jobs=1"], config_name="gavel"))
    names = fleet.type_names
    lines = ["| model, batch | " + " | ".join(f"{n} steps/s" for n in names) + " | P100 / K80 | V100 / K80 | plan on a V100 |",
             "|---|" + "---|" * (len(names) + 3)]
    for kind in cfg.trace.mix:
        job = Job("t", str(kind.model), int(kind.batch), 1.0)
        row = table.row(job)
        lines.append(f"| {kind.model}, {kind.batch} | " + " | ".join(f"{v:.4g}" for v in row)
                     + f" | {row[1] / row[2]:.1f}x | {row[0] / row[2]:.1f}x | {table.plan(job, fleet.types[0]).summary} |")
    lines += ["", "Table 6.1 (measured): " + "; ".join(f"{m} {p}x / {v}x" for m, p, v in TABLE_6_1) + "."]
    return "\n".join(lines)


def example_section(args: list[str] = EXAMPLE) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cluster_main(args)
    assert code == 0
    return f"```\n$ python -m planner.cluster {' '.join(args)}\n{buf.getvalue().rstrip()}\n```"


def examples(text: str) -> str:
    text = fill(fill(text, "example", example_section()), "example_water", example_section(WATER_EXAMPLE))
    for within, args in HIERARCHICAL_EXAMPLES.items():
        text = fill(text, f"example_hierarchical_{within}", example_section(args))
    return text


def fill(text: str, marker: str, body: str) -> str:
    return re.sub(rf"(<!-- {marker}:start -->\n).*?(<!-- {marker}:end -->)",
                  lambda m: m.group(1) + body.rstrip() + "\n" + m.group(2), text, flags=re.S)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*", help="experiment names to run; the others are kept from docs/cluster_sim.json")
    parser.add_argument("--sections-only", action="store_true",
                        help="refresh T and the example; the simulation table from docs/cluster_sim.json")
    args = parser.parse_args()
    if args.sections_only:
        text = fill(DOC.read_text(encoding="utf-8"), "sim", markdown(json.loads(SIM_JSON.read_text(encoding="utf-8"))))
        text = fill(text, "throughput", throughput_section())
        DOC.write_text(examples(text), encoding="utf-8")
        return 0
    start = time.time()
    done = []
    for name, policy, overrides, paper in EXPERIMENTS:
        if args.only and name not in args.only:
            continue
        done.append(run_pair(name, policy, quick(overrides) if args.quick else overrides, paper))
        print(f"{name}: {time.time() - start:.0f} s", flush=True)
    if not args.only or "space_sharing" in args.only:
        done.append(run_space(quick(SPACE[2]) if args.quick else SPACE[2]))
        print(f"space_sharing: {time.time() - start:.0f} s", flush=True)
    if not args.only or "cost" in args.only:
        done.append(run_cost(quick(COST[2]) if args.quick else COST[2]))
        print(f"cost: {time.time() - start:.0f} s", flush=True)
    if args.quick:
        print(markdown(done))
        return 0
    if args.only:  # keep the experiments not re-run, in the usual order
        fresh = {e["name"]: e for e in done}
        kept = {e["name"]: e for e in json.loads(SIM_JSON.read_text(encoding="utf-8"))}
        order = [e[0] for e in EXPERIMENTS] + [SPACE[0], COST[0]]
        done = [fresh.get(n) or kept[n] for n in order if n in fresh or n in kept]
    SIM_JSON.write_text(json.dumps(done, indent=1), encoding="utf-8")
    section = markdown(done)
    text = fill(DOC.read_text(encoding="utf-8"), "sim", section)
    DOC.write_text(examples(fill(text, "throughput", throughput_section())), encoding="utf-8")
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
