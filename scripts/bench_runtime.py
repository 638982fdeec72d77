"""Runtime benchmark: our pipeline runtime against torch.distributed.pipelining and against
single-process training, on the same blocks, global batch and micro-batching (2 stages, Gloo, one
thread per process). Writes docs/bench_runtime.json and its section of docs/benchmarks.md (every
number measured here, never typed); also two traced iterations of our 1f1b per workload, as
docs/img/bench_runtime/<workload>/ trace.json, timeline.png and timeline_predicted.png.

Run: .venv/bin/python scripts/bench_runtime.py          (about 6 minutes on a 2-core machine)
     .venv/bin/python scripts/bench_runtime.py --quick  (smoke run, tiny models, < 30 s; writes
                                                          nothing under docs/ unless --out-dir)

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench_load import Quiet, cpu_busy_jiffies, measured, other_load  # noqa: E402
from bench_runtime_report import analyse, machine, markdown, replace_section, targets  # noqa: E402

PP = 2
SECTION = "bench_runtime"
SCHEDULES = ("gpipe", "1f1b", "interleaved")
ASYNC_SCHEDULES = ("2bw", "pipedream")   # ours only: torch.distributed.pipelining has no asynchronous schedule
BOTH_CORES = "both cores"


@dataclass(frozen=True)
class Workload:
    """One model and batch shape; ``overrides`` are Hydra overrides of conf/config.yaml."""

    name: str
    overrides: tuple[str, ...]
    micro_batch: int
    microbatches: int
    description: str

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.microbatches


# Our 1f1b again with a runtime optimisation off, to show what each one buys (Hydra overrides).
VARIANTS = {
    "plain autograd": ("train.fuse_grad_accumulation=false", "train.weight_grads_after_send=false"),
    "no send-first": ("train.weight_grads_after_send=false",),
    "no delay": ("train.weight_grads_delay=0",),
}


@dataclass(frozen=True)
class Case:
    runtime: str        # pipedream | torch | single
    schedule: str       # gpipe | 1f1b | interleaved ("-" for single)
    variant: str = ""   # a key of VARIANTS (ours only)

    @property
    def name(self) -> str:
        if self.runtime == "single":
            return "single-process" + (f" [{self.variant}]" if self.variant else "")
        return f"{self.runtime} {self.schedule}" + (f" [{self.variant}]" if self.variant else "")

    @property
    def vpp(self) -> int:
        return 2 if self.schedule == "interleaved" else 1


def workloads(quick: bool) -> list[Workload]:
    common = ("optim=sgd", "train.lr=1e-4", "train.grad_clip=0", "data=synthetic")
    if quick:
        return [Workload("mlp", common + ("model=mlp", "model.num_layers=4", "model.hidden_size=64"), 4, 4,
                         "MLP, 4 blocks, hidden 64 (smoke run)")]
    return [
        Workload("mlp", common + ("model=mlp", "model.num_layers=8", "model.hidden_size=1024"), 32, 8,
                 "MLP, 8 residual blocks, hidden 1024 (2 Linear 1024x1024 each)"),
        Workload("gpt", common + ("model=gpt_tiny", "model.num_layers=4", "model.hidden_size=128",
                                  "model.num_heads=4", "model.seq_len=64", "model.tie_embeddings=false",
                                  "model.dropout=0.0"), 8, 8,
                 "GPT, 4 blocks, hidden 128, 4 heads, sequence 64, byte vocabulary, untied embeddings"),
    ]


def cases() -> list[Case]:
    flush = [Case(r, s) for s in SCHEDULES for r in ("pipedream", "torch")]
    # the single process again with a second copy running on the other core at the same time:
    # how fast one core computes while both work, which the ideal assumes to be as fast as alone
    return ([Case("single", "-"), Case("single", "-", BOTH_CORES)] + flush
            + [Case("pipedream", "1f1b", v) for v in VARIANTS]
            + [Case("pipedream", s) for s in ASYNC_SCHEDULES])


# The cases the targets compare run back to back, so each round's ratios see the same machine speed.
TARGET_CASES = ("torch 1f1b", "pipedream 1f1b", "single-process")


def run_order(names: list[str]) -> list[str]:
    """The order of one round: the target cases first, next to each other, then the rest."""
    return [n for n in TARGET_CASES if n in names] + [n for n in names if n not in TARGET_CASES]


# ---------------------------------------------------------------- one training step per runtime

def _compose(workload: Workload, case: Case) -> Any:
    from pipedream.config_loading import compose_config

    overrides = list(workload.overrides) + list(VARIANTS.get(case.variant, ())) + [
        f"train.micro_batch_size={workload.micro_batch}", f"train.global_batch_size={workload.global_batch}",
        f"schedule={case.schedule if case.schedule != '-' else '1f1b'}", f"parallel.pp={PP}",
        f"parallel.vpp={case.vpp}", "parallel.dp=1", "train.timeout_s=300",
        # asynchronous schedules build the whole run's action list up front: keep the run short
        f"train.steps={200 if case.schedule in ASYNC_SCHEDULES else 1000}"]
    return compose_config(overrides)


def _microbatches(model, workload: Workload) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)   # the same data on every rank
    return [model.make_batch(workload.micro_batch, generator) for _ in range(workload.microbatches)]


def _ours(workload: Workload, case: Case, rank: int, groups_cache: dict, recorder=None) -> Callable[[], None]:
    from models import build_model
    from pipedream.engine import PipelineEngine
    from pipedream.groups import build_groups
    from pipedream.run_spec import build_run_spec

    cfg = _compose(workload, case)
    spec = build_run_spec(cfg, PP)
    model = build_model(cfg.model, seed=1)
    if "groups" not in groups_cache:   # one mesh serves every case (pp=2, dp=tp=1, nothing tied)
        groups_cache["groups"] = build_groups(spec.layout, rank, "cpu", model, list(spec.bounds))
    engine = PipelineEngine(spec, model, rank, torch.device("cpu"), groups_cache["groups"], spec.optim, spec.train,
                            datetime.timedelta(seconds=300), recorder=recorder)
    batches = dict(enumerate(_microbatches(model, workload)))
    # no gradient norm: torch's loop computes none, and the trainer computes it only on logged steps
    return lambda: engine.train_step(batches, grad_norm=False)


def _torch(workload: Workload, case: Case, rank: int) -> Callable[[], None]:
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    from models import build_model
    from pipedream.layout import split_layers
    from pipedream.optim import build_optimizer
    from pipedream.run_spec import build_run_spec

    cfg = _compose(workload, case)
    spec = build_run_spec(cfg, PP)
    model = build_model(cfg.model, seed=1)
    stages_total = PP * case.vpp
    bounds = split_layers(spec.num_layers, stages_total)
    mine = [chunk * PP + rank for chunk in range(case.vpp)]   # round-robin, as ours
    built = model.build([i for vs in mine for i in range(*bounds[vs])])
    modules = [nn.Sequential(*(built[i] for i in range(*bounds[vs]))) for vs in mine]
    stages = [PipelineStage(m, vs, stages_total, torch.device("cpu")) for m, vs in zip(modules, mine)]
    if case.schedule == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=workload.microbatches, loss_fn=model.loss_fn)
    else:
        cls = Schedule1F1B if case.schedule == "1f1b" else ScheduleGPipe
        schedule = cls(stages[0], n_microbatches=workload.microbatches, loss_fn=model.loss_fn)
    optimizer = build_optimizer(spec.optim, [p for m in modules for p in m.parameters()], spec.train.lr)
    parts = _microbatches(model, workload)
    inputs, targets = torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])
    first, last = 0 in mine, stages_total - 1 in mine

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if first and last:
            schedule.step(inputs, target=targets, losses=losses)
        elif first:
            schedule.step(inputs)
        else:
            schedule.step(target=targets, losses=losses)
        optimizer.step()
    return step


def _single(workload: Workload, case: Case, rank: int) -> Callable[[], None]:
    """The whole model in one process: the same micro-batches, gradients accumulated, one update
    (on rank 0; with BOTH_CORES rank 1 runs its own copy at the same time)."""
    from models import build_model
    from pipedream.optim import build_optimizer
    from pipedream.specs import OptimSpec, TrainSpec

    cfg = _compose(workload, Case("pipedream", "1f1b"))
    model = build_model(cfg.model, seed=1)
    network = model.build_sequential()
    optimizer = build_optimizer(OptimSpec.from_config(cfg, (cfg.optim.name,)), list(network.parameters()),
                                TrainSpec.from_config(cfg).lr)
    parts = _microbatches(model, workload)
    scale = 1.0 / len(parts)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for x, y in parts:
            (model.loss_fn(network(x), y) * scale).backward()
        optimizer.step()
    return step if rank == 0 or case.variant == BOTH_CORES else (lambda: None)


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
    from pipedream.specs import TrainSpec
    from pipedream.trace import TraceRecorder, gather_traces
    from pipedream.trace_report import write_trace_outputs

    recorder = TraceRecorder()
    step = _ours(workload, Case("pipedream", "1f1b"), rank, groups_cache, recorder)
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
    delay = TrainSpec.from_config(_compose(workload, Case("pipedream", "1f1b"))).weight_grads_delay
    report = write_trace_outputs(out_dir, traces, "1f1b", PP, workload.microbatches, 1, weight_grads_delay=delay,
                                 metadata={"benchmark": workload.name})
    return {"report": report.as_dict() if report else None, "other_load": best_load}


def _worker(rank: int, port: int, quick: bool, warmup: int, block: int, repeats: int, result_path: str,
            trace_dir: str | None, max_other_load: float, tries: int, wait_budget_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=PP, timeout=datetime.timedelta(seconds=600))
    groups_cache: dict = {}
    builders = {"pipedream": lambda w, c: _ours(w, c, rank, groups_cache), "torch": lambda w, c: _torch(w, c, rank),
                "single": lambda w, c: _single(w, c, rank)}
    results: dict[str, Any] = {}
    quiet = Quiet(max_other_load, wait_budget_s)
    try:
        for workload in workloads(quick):
            steps = {case.name: builders[case.runtime](workload, case) for case in cases()}
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    out_dir = Path(args.out_dir) if args.out_dir else (None if args.quick else ROOT / "docs")
    trace_root = (out_dir / "img" / "bench_runtime") if out_dir else None
    started, busy_before = time.perf_counter(), cpu_busy_jiffies()
    with tempfile.TemporaryDirectory() as tmp:
        result_path = str(Path(tmp) / "result.json")
        trace_dir = str(trace_root) if trace_root else str(Path(tmp) / "trace")
        mp.start_processes(_worker, args=(_free_port(), args.quick, args.warmup, args.block, args.rounds,
                                          result_path, trace_dir, args.max_other_load, args.tries,
                                          args.wait_budget),
                           nprocs=PP, join=True, start_method="spawn")
        raw = json.loads(Path(result_path).read_text(encoding="utf-8"))
    own = sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
              for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    data: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "machine": machine(),
        "command": "python scripts/bench_runtime.py" + (" --quick" if args.quick else ""),
        "duration_s": time.perf_counter() - started,
        "other_load": other_load(busy_before, cpu_busy_jiffies(), own),
        "settings": {"rounds": args.rounds, "warmup": args.warmup, "block": args.block, "pp": PP,
                     "max_other_load": args.max_other_load, "tries": args.tries, "wait_budget_s": args.wait_budget},
        "workloads": {}}
    for workload in workloads(args.quick):
        result = raw[workload.name]
        data["workloads"][workload.name] = {
            "description": workload.description, "overrides": list(workload.overrides),
            "micro_batch": workload.micro_batch, "microbatches": workload.microbatches,
            "global_batch": workload.global_batch,
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
    parser.add_argument("--rounds", type=int, default=None, help="rounds over all cases (default 12)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed iterations per case (default 2)")
    parser.add_argument("--block", type=int, default=None, help="timed iterations per case and round (default 2)")
    parser.add_argument("--out-dir", help="where bench_runtime.json and benchmarks.md go (default docs/)")
    parser.add_argument("--max-other-load", type=float, default=0.15,
                        help="before a round, wait for other processes to use less than this share of the CPU")
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
