"""Planner start-up benchmark: how long ``python -m planner`` takes, end to end, for small plans.
Writes docs/bench_planner_startup.json, docs/bench_planner_startup.md and its section of
docs/benchmarks.md (numbers measured here, never typed).
Run: .venv/bin/python -m scripts.bench.planner_startup [--repeats 15] [--baseline DIR]
(``--baseline``: a checkout of another commit, e.g. ``git worktree add /tmp/base main``, whose
graph.txt run is measured beside this one's, with this interpreter.)

Each command runs in a fresh interpreter, the cases interleaved round by round so that the
machine's load falls on all of them alike; one warm-up run each first (it writes the bytecode and
the configs' parsed values, as any first run does). The figure is the minimum over the repeats, wall
and CPU (user + sys), beside ``python -c pass`` (the interpreter alone) and ``python -c "import
numpy"`` on the same load. The graph.txt case is also split by ``-X importtime`` (the least self
time of each module over the repeats, summed by top-level package).
"""
from __future__ import annotations

import argparse
import collections
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts import ROOT
from scripts.bench.planner import machine
from scripts.bench.runtime_report import write_report
from tests.support.graph_txt_profiles import vgg16_graph

GRAPH_RUN = ["planner.graph={graph}", "cluster=pipedream_cluster_a", "planner.algorithm=pipedream"]
CASES = {
    "interpreter": ("`python -c pass`", ["-c", "pass"]),
    "numpy": ("`python -c \"import numpy\"`", ["-c", "import numpy"]),
    "numpy_one_thread": ("`OPENBLAS_NUM_THREADS=1 python -c \"import numpy\"`", ["-c", "import numpy"]),
    "graph_txt": ("`python -m planner planner.graph=vgg16/graph.txt cluster=pipedream_cluster_a "
                  "planner.algorithm=pipedream` (VGG-16's 40 layers on 16 devices: PipeDream's DP, the "
                  "simulator check)", ["-m", "planner", *GRAPH_RUN]),
    "preset": ("`python -m planner model=gpt_tiny cluster=h100_x8 cluster.nodes=1 train.global_batch_size=16` "
               "(PTD-P on a preset cluster)",
               ["-m", "planner", "model=gpt_tiny", "cluster=h100_x8", "cluster.nodes=1", "train.global_batch_size=16"]),
    "torch": ("`python -c \"import torch\"`", ["-c", "import torch"]),
    "default": ("`python -m planner` (the default `cluster=local_cpu`), first run on a machine: measures "
                "this machine's matmul speed with torch", ["-m", "planner"]),
    "default_cached": ("`python -m planner` again: reads that speed from `local_cpu.json` in the cache folder",
                       ["-m", "planner"]),
}
SLOW = {"torch", "default"}   # a few repeats are enough for a run that takes seconds
ENV = {"numpy_one_thread": {"OPENBLAS_NUM_THREADS": "1"}}
FRESH_CACHE = {"default"}     # every run gets an empty cache folder (PIPEDREAM_CACHE_DIR)


def run_once(args: list[str], env: dict, cwd: Path = ROOT) -> tuple[float, float]:
    """(wall, user + sys CPU) seconds of one fresh interpreter running ``args`` in ``cwd``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"{' '.join(args)} failed: {done.stderr.strip().splitlines()[-1:]}")
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def import_split(args: list[str], env: dict, repeats: int) -> dict:
    """``-X importtime`` self times: the least of each module over ``repeats`` runs, summed by package."""
    least: dict[str, int] = {}
    for _ in range(repeats):
        done = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, check=True)
        for line in done.stderr.splitlines():
            if line.startswith("import time:") and "self [us]" not in line:
                self_us, _, name = line[len("import time:"):].split("|")
                least[name.strip()] = min(least.get(name.strip(), 10**12), int(self_us))
    packages: collections.Counter = collections.Counter()
    for name, micros in least.items():
        packages[name.split(".")[0]] += micros
    return {"total_s": sum(least.values()) / 1e6, "modules": len(least),
            "by_package_s": {name: micros / 1e6 for name, micros in packages.most_common(8)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--baseline", type=Path, default=None)
    parser.add_argument("--out", default=str(ROOT / "docs" / "bench_planner_startup"))
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "OPENBLAS_NUM_THREADS")}
    cases = dict(CASES)   # Python's default above: bytecode cached after the first run
    where = {name: ROOT for name in cases}
    if args.baseline is not None:
        cases["graph_txt_baseline"] = (f"the same graph.txt run, {baseline_label(args.baseline)}", CASES["graph_txt"][1])
        where["graph_txt_baseline"] = args.baseline.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        graph = Path(tmp) / "vgg16" / "graph.txt"
        graph.parent.mkdir()
        graph.write_text(vgg16_graph())
        commands = {name: [a.format(graph=graph) for a in argv] for name, (_, argv) in cases.items()}
        env["PIPEDREAM_CACHE_DIR"] = str(Path(tmp) / "cache")   # the cached case's, filled by its warm-up

        def env_for(name: str) -> dict:
            fresh = {"PIPEDREAM_CACHE_DIR": tempfile.mkdtemp(dir=tmp)} if name in FRESH_CACHE else {}
            return {**env, **ENV.get(name, {}), **fresh}

        for name, argv in commands.items():
            run_once(argv, env_for(name), where[name])   # warm-up
        walls: dict[str, list[float]] = {name: [] for name in cases}
        cpus: dict[str, list[float]] = {name: [] for name in cases}
        load_before = os.getloadavg()[0]
        for round_ in range(args.repeats):
            for name, argv in commands.items():
                if name in SLOW and round_ >= 3:
                    continue
                wall, cpu = run_once(argv, env_for(name), where[name])
                walls[name].append(wall)
                cpus[name].append(cpu)
        load_after = os.getloadavg()[0]
        split = import_split(commands["graph_txt"], env, min(args.repeats, 8))
    cases = {name: {"what": cases[name][0], "runs": len(walls[name]), "wall_min_s": min(walls[name]),
                    "wall_median_s": statistics.median(walls[name]), "cpu_min_s": min(cpus[name])}
             for name in cases}
    report = {"machine": {**machine(), "load_average_1min": [load_before, load_after]}, "cases": cases,
              "graph_txt_imports": split}
    write_report(Path(args.out), report, markdown(report), "bench_planner_startup")
    return 0


def baseline_label(path: Path) -> str:
    """'commit 98e83e5 (Docs: ...)' for the checkout measured as the baseline (its folder's name for an export)."""
    done = subprocess.run(["git", "-C", str(path), "log", "-1", "--format=%h (%s)"], capture_output=True, text=True)
    return f"commit {done.stdout.strip()}" if done.returncode == 0 else f"`{path.name}`"


def markdown(report: dict) -> str:
    m, cases, split = report["machine"], report["cases"], report["graph_txt_imports"]
    lines = ["## Planner start-up", "",
             f"Measured by `python -m scripts.bench.planner_startup` on {m['date']}: {m['cpu']} ({m['cores']} "
             f"cores, shared: 1-minute load average {m['load_average_1min'][0]:.1f} before, "
             f"{m['load_average_1min'][1]:.1f} after), Python {m['python']}, numpy {m['numpy']}. Fresh "
             "interpreters, the cases interleaved, bytecode cached; the least of the runs (the machine's "
             "other work only ever adds); the raw numbers are in `docs/bench_planner_startup.json`.", "",
             "| case | runs | wall (min) | wall (median) | CPU user+sys (min) |", "|---|---|---|---|---|"]
    for case in cases.values():
        lines.append(f"| {case['what']} | {case['runs']} | {case['wall_min_s']:.3f} s | {case['wall_median_s']:.3f} s "
                     f"| {case['cpu_min_s']:.3f} s |")
    packages = ", ".join(f"{name} {seconds:.3f} s" for name, seconds in split["by_package_s"].items())
    lines += ["", f"The graph.txt run's imports (`-X importtime`, {split['modules']} modules, the least self time "
                  f"of each): {split['total_s']:.3f} s in all; by package: {packages}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
