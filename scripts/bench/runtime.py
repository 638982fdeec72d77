"""Runtime benchmark: our pipeline runtime against torch.distributed.pipelining and against
single-process training, on the same blocks, global batch and micro-batching (2 stages, Gloo, one
thread per process). Writes docs/bench_runtime.json and its section of docs/benchmarks.md (every
number measured here, never typed); also two traced iterations of our 1f1b per workload, as
docs/img/bench_runtime/<workload>/ trace.json, timeline.png and timeline_predicted.png.

Run: .venv/bin/python -m scripts.bench.runtime                 (every case)
     .venv/bin/python -m scripts.bench.runtime --targets-only  (only the cases the targets compare: no
                                                                 runtime-optimisation variants, no
                                                                 asynchronous schedules)
     .venv/bin/python -m scripts.bench.runtime --workloads stock  (one workload; writes nothing under
                                                                 docs/ unless --out-dir)
     .venv/bin/python -m scripts.bench.runtime --quick         (smoke run, tiny models; writes
                                                                 nothing under docs/ unless --out-dir)
Each process is pinned to its own core (``--bind-cores none``: not pinned); ours, torch's and the
single process run in the same processes, so they share the binding.
The run's duration is printed at its end and recorded in the JSON (``duration_s``).

Every case of a workload is built once and warmed up; then each round runs every case for a short
block of iterations, one case after the other (the order reversed every other round), so all
cases of a round see the same phase of a shared machine. Ratios are taken case against case within
each round, then their median: on a machine whose speed drifts by 20% over minutes, the paired
ratio is what stays put. Tables give medians and min-max over rounds.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scripts import ROOT
from scripts.bench.load import Quiet, cpu_busy_jiffies, measured, other_load
from scripts.bench.runtime_cases import PP, Case, Workload, cases, run_order, workloads
from scripts.bench.runtime_report import analyse, machine, markdown, replace_section
from scripts.bench.runtime_steps import compose, ours, single, theirs
from scripts.bench.runtime_targets import targets

SECTION = "bench_runtime"


def _block(step: Callable[[], None], steps: int) -> tuple[float, float]:
    """Seconds per iteration over ``steps`` iterations, and the other processes' CPU share."""
    def run() -> None:
        for _ in range(steps):
            step()
    elapsed, load = measured(run)
    return elapsed / steps, load


def _traced_iteration(workload: Workload, rank: int, groups_cache: dict, out_dir: Path, tries: int,
                      quiet: Quiet) -> dict | None:
    """Two traced iterations of our 1f1b after warm-up (the least disturbed of ``tries`` attempts),
    written as trace.json and the timeline PNGs."""
    from pipedream.config.specs import TrainSpec
    from pipedream.observe.trace import TraceRecorder, gather_traces
    from pipedream.observe.trace_report import write_trace_outputs

    recorder = TraceRecorder()
    step = ours(workload, Case("pipedream", "1f1b"), rank, groups_cache, recorder)
    for _ in range(2):
        step()
    kept: dict[str, Any] = {}

    def run() -> None:
        recorder.steps.clear()
        for i in range(2):
            recorder.begin_step(i + 1, traced=True, barrier=dist.barrier)
            step()
            recorder.end_step()

    best_load = float("inf")
    for _ in range(tries):
        quiet.wait(rank)
        _, load = measured(run)
        if load < best_load:
            best_load, kept["steps"] = load, list(recorder.steps)
        if load <= quiet.max_other_load:
            break
    recorder.steps[:] = kept["steps"]
    traces = gather_traces(recorder, rank, rank, 0, PP)
    if traces is None:
        return None
    delay = TrainSpec.from_config(compose(workload, Case("pipedream", "1f1b"))).weight_grads_delay
    report = write_trace_outputs(out_dir, traces, "1f1b", PP, workload.microbatches, 1, weight_grads_delay=delay,
                                 metadata={"benchmark": workload.name})
    return {"report": report.as_dict() if report else None, "other_load": best_load}


def chosen(quick: bool, names: list[str] | None) -> list[Workload]:
    return [w for w in workloads(quick) if names is None or w.name in names]


def core_sets(bind: bool) -> list[tuple[int, ...]] | None:
    """One disjoint core set per process (as ``launcher.bind_cores=auto`` gives the ranks), or None
    where nothing is bound (``--bind-cores none``, or fewer usable cores than processes)."""
    from pipedream.runtime.affinity import even_sets

    cores = sorted(os.sched_getaffinity(0))
    return even_sets(cores, PP) if bind and len(cores) >= PP else None


def _worker(rank: int, port: int, quick: bool, names: list[str] | None, targets_only: bool, warmup: int, block: int, repeats: int,
            result_path: str, trace_dir: str | None, max_other_load: float, tries: int,
            wait_budget_s: float, cores: list[tuple[int, ...]] | None) -> None:
    if cores is not None:   # before Gloo starts its threads, which inherit the set; ours and torch's alike
        os.sched_setaffinity(0, cores[rank])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=PP, timeout=datetime.timedelta(seconds=600))
    groups_cache: dict = {}
    builders = {"pipedream": lambda w, c: ours(w, c, rank, groups_cache), "torch": lambda w, c: theirs(w, c, rank),
                "single": lambda w, c: single(w, c, rank)}
    results: dict[str, Any] = {}
    quiet = Quiet(max_other_load, wait_budget_s)
    try:
        for workload in chosen(quick, names):
            steps = {case.name: builders[case.runtime](workload, case)
                     for case in cases(workload.name, targets_only)}
            for step in steps.values():
                for _ in range(warmup):
                    step()
            times: dict[str, list[float]] = {name: [] for name in steps}
            loads: dict[str, list[float]] = {name: [] for name in steps}
            for repeat in range(repeats):
                quiet.wait(rank)
                order = run_order(list(steps))
                order = order if repeat % 2 == 0 else order[::-1]   # alternate the order too
                for name in order:
                    seconds, load = _block(steps[name], block)
                    times[name].append(seconds)
                    loads[name].append(load)
                if rank == 0:
                    print(f"[{workload.name}] round {repeat + 1}/{repeats}: " + ", ".join(
                        f"{k} {v[-1] * 1e3:.0f} ms" for k, v in times.items()), flush=True)
            del steps
            traced = None
            if trace_dir is not None:
                traced = _traced_iteration(workload, rank, groups_cache, Path(trace_dir) / workload.name,
                                           tries, quiet)
            results[workload.name] = {"times_s": times, "other_load": loads, "traced": traced,
                                      "waited_for_quiet_s": quiet.waited_s}
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(result_path).write_text(json.dumps(results, default=str), encoding="utf-8")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def layer_splits(workload: Workload) -> dict[str, list[int]]:
    """Layers per (virtual) stage that both runtimes run, per placement: the runtime's default split."""
    from pipedream.config.run_spec import build_run_spec

    placements = {"one chunk per rank": "1f1b", "interleaved": "interleaved", "V": "zbv"}
    return {where: [end - start for start, end in build_run_spec(compose(workload, Case("pipedream", schedule))).bounds]
            for where, schedule in placements.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out_dir = Path(args.out_dir) if args.out_dir else (None if args.quick or args.workloads else ROOT / "docs")
    trace_root = (out_dir / "img" / "bench_runtime") if out_dir else None
    started, busy_before = time.perf_counter(), cpu_busy_jiffies()
    cores = core_sets(args.bind_cores == "auto")
    with tempfile.TemporaryDirectory() as tmp:
        result_path = str(Path(tmp) / "result.json")
        trace_dir = str(trace_root) if trace_root else str(Path(tmp) / "trace")
        mp.start_processes(_worker, args=(_free_port(), args.quick, args.workloads, args.targets_only, args.warmup, args.block,
                                          args.rounds, result_path, trace_dir, args.max_other_load, args.tries,
                                          args.wait_budget, cores),
                           nprocs=PP, join=True, start_method="spawn")
        raw = json.loads(Path(result_path).read_text(encoding="utf-8"))
    own = sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
              for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    data: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "machine": machine(),
        "command": "python -m scripts.bench.runtime" + (" --quick" if args.quick else "")
                   + (f" --workloads {' '.join(args.workloads)}" if args.workloads else "")
                   + (" --targets-only" if args.targets_only else ""),
        "duration_s": time.perf_counter() - started,
        "other_load": other_load(busy_before, cpu_busy_jiffies(), own),
        "settings": {"rounds": args.rounds, "warmup": args.warmup, "block": args.block, "pp": PP,
                     "max_other_load": args.max_other_load, "tries": args.tries, "wait_budget_s": args.wait_budget,
                     "core_sets": cores},
        "workloads": {}}
    for workload in chosen(args.quick, args.workloads):
        result = raw[workload.name]
        data["workloads"][workload.name] = {
            "description": workload.description, "overrides": list(workload.overrides),
            "micro_batch": workload.micro_batch, "microbatches": workload.microbatches,
            "global_batch": workload.global_batch,
            "layers_per_stage": layer_splits(workload),
            "cases": analyse(result["times_s"], workload.global_batch, workload.microbatches, PP),
            "other_load_per_run": result["other_load"],
            "traced": result["traced"]}
    data["targets"] = targets(data)
    if out_dir:
        images = {w: f"img/bench_runtime/{w}" for w in data["workloads"]} if trace_root else {}
        (out_dir / "bench_runtime.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        replace_section(out_dir / "benchmarks.md", SECTION, markdown(data, images))
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, 1 round, few steps (smoke run)")
    parser.add_argument("--targets-only", action="store_true",
                        help="only the cases the targets compare (no runtime-optimisation variants, no asynchronous "
                             "schedules; on the MLP no gpipe or interleaved)")
    parser.add_argument("--workloads", nargs="+", choices=[w.name for w in workloads(False)],
                        help="only these workloads (default all); a partial run writes nothing under docs/ "
                             "unless --out-dir")
    parser.add_argument("--rounds", type=int, default=None, help="rounds over all cases (default 12)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed iterations per case (default 2)")
    parser.add_argument("--block", type=int, default=None, help="timed iterations per case and round (default 2)")
    parser.add_argument("--out-dir", help="where bench_runtime.json and benchmarks.md go (default docs/)")
    parser.add_argument("--max-other-load", type=float, default=0.15,
                        help="before a round, wait for other processes to use less than this share of the CPU")
    parser.add_argument("--bind-cores", choices=("auto", "none"), default="auto",
                        help="auto: each process pinned to its own cores (as launcher.bind_cores=auto pins the ranks); "
                             "ours, torch's and the single process run in the same pinned processes")
    parser.add_argument("--tries", type=int, default=None, help="attempts at a quiet traced iteration (default 2)")
    parser.add_argument("--wait-budget", type=float, default=None,
                        help="seconds the whole benchmark may wait for other processes to go quiet (default 30)")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 12)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.block = args.block or 2
    args.tries = args.tries or (1 if args.quick else 2)
    args.wait_budget = args.wait_budget if args.wait_budget is not None else (0.0 if args.quick else 30.0)
    data = run(args)
    for name, w in data["workloads"].items():
        for case_name, row in w["cases"].items():
            extra = f"  vs torch {row['vs_torch']['median']:.2f}x" if "vs_torch" in row else ""
            extra += f"  of ideal {row['of_ideal']['median']:.0%}" if "of_ideal" in row else ""
            print(f"{name:4} {case_name:38} {row['step_time_s']['median'] * 1e3:8.1f} ms{extra}")
    for t in data["targets"]:
        print(f"target {t['name']}: {'met' if t['met'] else 'NOT met'} ({t['value']:.3f})")
    print(f"done in {data['duration_s']:.0f} s; other processes used {data['other_load'] or 0:.0%} of the CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
