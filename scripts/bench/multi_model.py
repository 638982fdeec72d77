"""K small models trained at once, fused (``train.models=K``), against the same K trained one after
another in one process, and against K separate processes running side by side.

Every mode trains the same K models (seeds ``seed .. seed+K-1``, the same steps and batches) with
one intra-op thread per process, each mode in fresh processes (so each has its own peak RSS):

- fused: one process, ``train.models=K`` (the fusion degree as ``train.fusion_groups`` says);
- sequential: one process running the K single-model trainings one after another;
- processes: K processes at once, one model each.

Then, in a fresh process, the layers' own forward and backward are timed alone (one model, and the
K fused): the least a fused step can cost, and so the most fusion can give on this machine.

Throughput is samples of all K models per second of training steps (the median step time after
warm-up from each run's summary; for the side-by-side processes the sum of their rates), memory
the peak RSS (summed over the side-by-side processes). The share of the CPU that other processes
used while each mode ran is recorded, since on a shared machine that moves the times. The modes
run in rounds (their order alternating), and the table gives each mode's median over the rounds
and the median of the per-round ratios to the sequential run of the same round.

Run: .venv/bin/python -m scripts.bench.multi_model [--models 4] [--steps 20] [--rounds 5]
     .venv/bin/python -m scripts.bench.multi_model --report-only docs/bench_multi_model.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from scripts import ROOT
from scripts.bench.load import cpu_busy_jiffies, other_load
from scripts.bench.runtime_report import machine, write_report

SECTION = "bench_multi_model"
MODEL = ["model=gpt_tiny", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=2", "model.seq_len=32",
         "train.global_batch_size=8", "train.micro_batch_size=8", "parallel.pp=1", "parallel.dp=1",
         "train.eval_every=0", "train.eval_batches=1", "train.progress=false", "trace.enabled=false",
         "train.warmup_steps=2", "train.threads=1"]
SEED = 100


def _worker(overrides_list: list[list[str]], out: str) -> None:
    """Runs the trainings one after another in this process; writes their summaries' numbers."""
    import torch

    from pipedream.config.loading import compose_config
    from pipedream.runtime.distributed import init_distributed, shutdown
    from pipedream.observe.metrics import peak_memory_bytes
    from pipedream.config.run_spec import build_run_spec
    from pipedream.trainer import train

    torch.set_num_threads(1)
    ctx = init_distributed("cpu", 120)
    results = []
    try:
        for overrides in overrides_list:
            cfg = compose_config(overrides)
            summary = train(build_run_spec(cfg, 1), ctx).summary
            results.append({"median_step_time_s": summary["median_step_time_s"],
                            "samples_per_step": summary["batch"]["global"] * (len(summary.get("models") or []) or 1),
                            "final_train_loss": summary["final_train_loss"]})
    finally:
        shutdown()
    Path(out).write_text(json.dumps({"runs": results, "peak_rss_bytes": peak_memory_bytes(torch.device("cpu"))["rss"]}))


def layer_arithmetic(overrides: list[str], models: int, repeats: int = 60) -> dict[str, float]:
    """The forward and backward (and loss) of the model's layers alone, without the training loop:
    one model (seed ``SEED``), and the ``models`` models fused, each the median over ``repeats``
    timed passes on one thread. What a fused step can cost at least, whatever the loop around it."""
    import torch

    from models import build_model
    from pipedream.config.loading import compose_config
    from pipedream.multi_model.fused import fuse_models

    cfg = compose_config(overrides)
    batch = int(cfg.train.micro_batch_size)
    members = [build_model(cfg.model, seed=SEED + k) for k in range(models)]
    fused = fuse_models(members, settings=None)

    def pass_time(model: Any) -> float:
        layers = model.build_sequential()
        inputs, targets = model.make_batch(batch, torch.Generator().manual_seed(0))
        times = []
        for _ in range(repeats + 5):   # the first passes warm up (allocator, the fused layers' fold check)
            started = time.perf_counter()
            model.loss_fn(layers(inputs), targets).backward()
            times.append(time.perf_counter() - started)
            layers.zero_grad(set_to_none=True)
        return statistics.median(times[5:])

    single = pass_time(members[0])
    return {"single_s": single, "fused_s": pass_time(fused), "repeats": repeats}


def _spawn(argument: Any, out: Path, port: int, worker: str = "--worker") -> subprocess.Popen:
    """A fresh one-thread process running ``worker`` (``--worker`` or ``--arithmetic``) on ``argument``."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "scripts.bench.multi_model", worker, json.dumps(argument),
                             str(out)], env=env, cwd=ROOT, stdout=subprocess.DEVNULL)


def _arithmetic_worker(models: int, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    Path(out).write_text(json.dumps(layer_arithmetic(MODEL, models)))


def _measure_arithmetic(models: int, work: Path) -> dict[str, float]:
    """``layer_arithmetic`` of the benchmark's model in a fresh process (one thread), as the modes run."""
    out = work / "arithmetic.json"
    process = _spawn(models, out, 0, worker="--arithmetic")
    if process.wait() != 0:
        raise SystemExit(f"error: the layer timing failed (exit {process.returncode})")
    return json.loads(out.read_text())


def _mode(name: str, jobs: list[list[list[str]]], work: Path, port: int) -> dict[str, Any]:
    """Runs ``jobs`` (one process each) at once; returns their numbers and the machine's load."""
    before, own_before, started = cpu_busy_jiffies(), resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    outs = [work / f"{name}_{i}.json" for i in range(len(jobs))]
    processes = [_spawn(job, out, port + i) for i, (job, out) in enumerate(zip(jobs, outs))]
    for process in processes:
        if process.wait() != 0:
            raise SystemExit(f"error: the {name} run failed (exit {process.returncode})")
    wall = time.perf_counter() - started
    own = resource.getrusage(resource.RUSAGE_CHILDREN)
    own_cpu = own.ru_utime + own.ru_stime - own_before.ru_utime - own_before.ru_stime
    results = [json.loads(out.read_text()) for out in outs]
    runs = [run for result in results for run in result["runs"]]
    if name == "processes":   # side by side: their rates add up
        samples_per_s = sum(r["samples_per_step"] / r["median_step_time_s"] for r in runs)
    else:                     # one process: its trainings' step times add up
        samples_per_s = sum(r["samples_per_step"] for r in runs) / sum(r["median_step_time_s"] for r in runs)
    return {"samples_per_s": samples_per_s, "peak_rss_bytes": sum(r["peak_rss_bytes"] for r in results),
            "processes": len(jobs), "wall_s": wall, "other_load": other_load(before, cpu_busy_jiffies(), own_cpu),
            "runs": runs}


MODES = ("fused", "sequential", "processes")


def _median_mode(rounds: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """One mode's medians over the rounds, and its per-round ratio to that round's sequential run."""
    runs = [r[name] for r in rounds]
    median = (lambda key: statistics.median(m[key] for m in runs))
    loads = [m["other_load"] for m in runs if m["other_load"] is not None]
    return {"samples_per_s": median("samples_per_s"), "peak_rss_bytes": median("peak_rss_bytes"),
            "processes": runs[0]["processes"], "wall_s": median("wall_s"),
            "other_load": statistics.median(loads) if loads else None,
            "vs_sequential": statistics.median(r[name]["samples_per_s"] / r["sequential"]["samples_per_s"]
                                               for r in rounds),
            "rss_vs_sequential": statistics.median(r[name]["peak_rss_bytes"] / r["sequential"]["peak_rss_bytes"]
                                                   for r in rounds),
            "samples_per_s_by_round": [m["samples_per_s"] for m in runs]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    common = MODEL + [f"train.steps={args.steps}", f"train.log_every={args.steps}", "train.overwrite=true"]
    models = f"[{','.join(f'{{seed:{SEED + k}}}' for k in range(args.models))}]"
    fused = common + [f"train.models={models}", f"train.fusion_groups={args.fusion_groups}",
                      f"train.run_dir={work / 'fused'}"]
    alone = [common + [f"train.seed={SEED + k}", f"train.run_dir={work / f'alone_{k}'}"] for k in range(args.models)]
    jobs = {"fused": [[fused]], "sequential": [alone], "processes": [[job] for job in alone]}
    rounds = []
    for index in range(args.rounds):
        order = MODES if index % 2 == 0 else MODES[::-1]   # neither mode always meets the machine first
        rounds.append({name: _mode(name, jobs[name], work, args.port + 10 * MODES.index(name)) for name in order})
    return {"machine": machine(), "models": args.models, "steps": args.steps, "fusion_groups": args.fusion_groups,
            "rounds": args.rounds, "workload": " ".join(MODEL),
            "modes": {name: _median_mode(rounds, name) for name in MODES}, "by_round": rounds,
            "arithmetic": _measure_arithmetic(args.models, work)}


def _share(load: float | None) -> str:
    return "n/a" if load is None else f"{load:.0%}"


def arithmetic_bound(data: dict[str, Any]) -> str:
    """The paragraph on the layers' own forward and backward (``layer_arithmetic``): the rate a fused
    step costing nothing else would reach, against the sequential run's."""
    timing = data.get("arithmetic")
    if not timing:
        return ""
    count = data["models"]
    batch = data["by_round"][0]["sequential"]["runs"][0]["samples_per_step"]
    sequential = data["modes"]["sequential"]["samples_per_s"]
    step = batch / sequential   # one model's training step in the sequential run (rates of all models)
    ceiling = count * batch / timing["fused_s"] / sequential
    return (f"The layers' own arithmetic, timed alone (forward, loss and backward of one micro-batch, no "
            f"optimizer or training loop; median of {timing['repeats']} passes, one thread): one model {timing['single_s'] * 1e3:.2f} "
            f"ms, {timing['single_s'] / step:.0%} of its training step in the sequential run ({step * 1e3:.2f} ms); "
            f"the {count} fused {timing['fused_s'] * 1e3:.2f} ms, {timing['fused_s'] / (count * timing['single_s']):.2f}x "
            f"their {count} separate passes. A fused step that cost nothing beyond its layers' forward and backward "
            f"would reach {ceiling:.2f}x the sequential rate: the most fusion can give on this CPU core for this model.")


def markdown(data: dict[str, Any]) -> str:
    modes = data["modes"]
    rows = [f"| {name} | {m['processes']} | {m['samples_per_s']:.1f} | {m['vs_sequential']:.2f} | "
            f"{m['peak_rss_bytes'] / 2**20:.0f} | {m['wall_s']:.1f} | {_share(m['other_load'])} |"
            for name, m in modes.items()]
    fused, processes = modes["fused"], modes["processes"]
    cores = data["machine"]["cores"]
    used = min(processes["processes"], cores)
    per_core = fused["vs_sequential"] / (processes["vs_sequential"] / used)
    by_round = ", ".join(f"{r['fused']['samples_per_s'] / r['sequential']['samples_per_s']:.2f}"
                         for r in data["by_round"])
    return "\n".join([
        f"## Multi-model training: {data['models']} models fused vs one after another vs separate processes",
        "",
        f"`python -m scripts.bench.multi_model`: {data['models']} GPT models ({data['workload']}), {data['steps']} steps "
        f"each, train.fusion_groups={data['fusion_groups']}, one intra-op thread per process, on "
        f"{data['machine']['cpu']} ({cores} cores), torch {data['machine']['torch']}; {data['rounds']} rounds, each "
        f"mode in fresh processes, medians over the rounds (\"vs sequential\": the median of the per-round "
        f"ratios to the sequential run of the same round).",
        "",
        "| mode | processes | samples/s (all models) | vs sequential | peak RSS (MiB, summed) | wall (s) | other load |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        f"Fused runs {fused['vs_sequential']:.2f}x the throughput of training the models one after another in "
        f"one process (per round: {by_round}), with {fused['rss_vs_sequential']:.2f}x its peak RSS; "
        f"{processes['processes']} separate processes reach {processes['vs_sequential']:.2f}x on {used} cores, "
        f"{processes['vs_sequential'] / used:.2f}x per core, so the fused run on its one core does "
        f"{per_core:.2f}x the separate processes' work per core, with "
        f"{fused['peak_rss_bytes'] / processes['peak_rss_bytes']:.2f}x their memory.",
        "",
        f"The CPU's limits: one thread per process, so the fused run uses one core while {processes['processes']} "
        f"processes share {cores}. A CPU core has no idle compute units for fusion to fill, as a GPU running small "
        f"kernels has: fusion saves the per-step work of the training loop (K-1 of every K steps), per-operator "
        f"dispatch (one batched matmul for K, one attention call over K*B sequences, layers folded into one "
        f"batch) and no copy of the weights (they are stacked once); the arithmetic itself stays, so the gain "
        f"is bounded by the share of a single model's step that is not arithmetic. "
        f"Other processes' share of the CPU while each mode ran is in the table: on a shared machine it moves "
        f"the times by tens of percent.",
        "",
        *([arithmetic_bound(data), ""] if data.get("arithmetic") else []),
    ])


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] in ("--worker", "--arithmetic"):
        (_worker if sys.argv[1] == "--worker" else _arithmetic_worker)(json.loads(sys.argv[2]), sys.argv[3])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of all modes; medians are reported")
    parser.add_argument("--fusion-groups", default="1", help="1 (all fused), a divisor of --models, or auto")
    parser.add_argument("--port", type=int, default=29640)
    parser.add_argument("--work-dir", default=str(ROOT / "runs" / "bench_multi_model"))
    parser.add_argument("--out-dir", default=str(ROOT / "docs"))
    parser.add_argument("--report-only", metavar="JSON", help="rewrite the Markdown from a saved JSON, measure nothing")
    args = parser.parse_args()
    data = json.loads(Path(args.report_only).read_text()) if args.report_only else run(args)
    write_report(Path(args.out_dir) / SECTION, data, markdown(data), SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
