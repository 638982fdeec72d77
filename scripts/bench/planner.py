"""Planner speed benchmark: writes docs/bench_planner.json, docs/bench_planner.md and its section of
docs/benchmarks.md (numbers measured
here, never typed). Run: .venv/bin/python -m scripts.bench.planner [--repeats 5]

Cases: PipeDream's hierarchical DP with replication for a 96-block GPT on 16 nodes x 8 devices (one
micro-batch size, and the full search over micro-batch sizes); the PTD-P search for the trillion-
parameter GPT on 3072 devices; the whole dry run (search + simulator check) for the same.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from planner.search.auto import make_plan
from planner.config import compose, inputs_from_config
from planner.search.pipedream_dp import DPOptions, MemoryModel, pipedream_dp
from planner.search.pipedream_search import search_candidates
from planner.search.ptdp import ptdp_search
from scripts import ROOT
from scripts.bench.runtime_report import write_report


def timed(fn, repeats: int) -> dict:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "repeats": repeats}


def machine() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
            "platform": platform.platform(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "docs" / "bench_planner"))
    args = parser.parse_args()

    dp_cfg = compose(["model=gpt3_175b", "cluster=dgx_a100", "cluster.nodes=16", "train.global_batch_size=512"])
    dp_inputs = inputs_from_config(dp_cfg)
    memory = MemoryModel(dp_inputs.capacity, dp_inputs.workspace, recompute=True)
    one = lambda: pipedream_dp(dp_inputs.profile, dp_inputs.cluster, 1, DPOptions(), memory)  # noqa: E731
    result = one()
    sweep_inputs = replace(dp_inputs, recompute=(True,))
    pt_cfg = compose(["model=gpt_1t", "cluster=dgx_a100", "cluster.nodes=384", "train.global_batch_size=3072"])
    pt_inputs = inputs_from_config(pt_cfg)
    best = ptdp_search(pt_inputs)

    cases = {
        "pipedream_dp_96_blocks_16x8": {
            "what": "hierarchical DP with replication and memory constraint, GPT-3 175B (96 blocks + embedding + "
                    "head = 98 layers), 16 nodes x 8 A100, one micro-batch size (b = 1)",
            "layers": dp_inputs.profile.num_layers, "devices": dp_inputs.cluster.num_devices,
            "stages_found": len(result.stages) if result else 0,
            **timed(one, args.repeats)},
        "pipedream_search_96_blocks_16x8": {
            "what": "the same DP for every micro-batch size dividing B = 512 up to 32 (6 DPs) plus the "
                    "data-parallel baseline, with recomputation (the candidates only: none fits in the flattened "
                    "pipeline, where weight stashing keeps a version per in-flight input)",
            **timed(lambda: search_candidates(sweep_inputs), args.repeats)},
        "ptdp_search_3072": {
            "what": "PTD-P search over (p, t, d, b, v, recompute, schedule), GPT 1T (128 blocks), 384 nodes x 8 A100, "
                    "B = 3072",
            "devices": pt_inputs.cluster.num_devices, "configurations": best.considered,
            "chosen": best.best.describe(),
            **timed(lambda: ptdp_search(pt_inputs), args.repeats)},
        "dry_run_3072": {
            "what": "make_plan for the same: search, ranking, alternatives and the simulator check",
            **timed(lambda: make_plan(pt_inputs), max(1, args.repeats // 2))},
    }
    report = {"machine": machine(), "cases": cases}

    write_report(Path(args.out), report, markdown(report), "bench_planner")
    return 0


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = ["## Planner speed", "",
             f"Measured by `python -m scripts.bench.planner` on {m['date']}: {m['cpu']} ({m['cores']} cores), "
             f"Python {m['python']}, numpy {m['numpy']}, {m['platform']}. Median of the repeats after one warm-up "
             f"run; the raw numbers are in `docs/bench_planner.json`.", "",
             "| case | what | median | min | max |", "|---|---|---|---|---|"]
    for name, case in report["cases"].items():
        lines.append(f"| `{name}` | {case['what']} | {case['median_s'] * 1e3:.0f} ms | {case['min_s'] * 1e3:.0f} ms "
                     f"| {case['max_s'] * 1e3:.0f} ms |")
    pt = report["cases"]["ptdp_search_3072"]
    dp = report["cases"]["pipedream_dp_96_blocks_16x8"]
    lines += ["", f"The DP split the {dp['layers']} layers into {dp['stages_found']} replicated stages over "
                  f"{dp['devices']} devices; the PTD-P search evaluated {pt['configurations']} configurations over "
                  f"{pt['devices']} devices and chose {pt['chosen']}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
