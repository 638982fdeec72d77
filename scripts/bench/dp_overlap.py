"""Step time of data-parallel training (dp=2, pp=1, Gloo on CPU, one thread per process) with the
gradient buckets' all-reduce overlapped with the backward (``train.overlap_grad_reduce=true``)
and with every bucket reduced at the sync (``false``). Both engines are built in the same two
processes and measured round by round, alternating which goes first, so a shared machine's drift
falls on both alike; the table gives medians and min-max over rounds and the median of the
per-round ratio. Writes docs/bench_dp_overlap.json and docs/bench_dp_overlap.md (every number
measured here).

    .venv/bin/python -m scripts.bench.dp_overlap [--hidden 256] [--rounds 15] [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from scripts import ROOT
from tests.support.workers import run_workers

CASES = {"overlap": "train.overlap_grad_reduce=true", "at sync": "train.overlap_grad_reduce=false"}


def _engines(rank: int, args: argparse.Namespace) -> tuple[dict, dict]:
    from models import build_model
    from pipedream.config.loading import compose_config
    from pipedream.config.run_spec import build_run_spec
    from pipedream.runtime.engine import PipelineEngine
    from pipedream.runtime.groups import build_groups

    micro, m = 4, args.microbatches
    base = ["model=gpt_tiny", f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
            "model.num_heads=4", f"model.seq_len={args.seq}", "parallel.pp=1", "parallel.dp=2", "schedule=1f1b",
            f"train.micro_batch_size={micro}", f"train.global_batch_size={2 * micro * m}", "train.steps=1000",
            f"train.grad_bucket_mb={args.bucket_mb}", "train.timeout_s=300"]
    engines, groups = {}, None
    for name, override in CASES.items():
        cfg = compose_config(base + [override])
        spec = build_run_spec(cfg, 2)
        model = build_model(cfg.model, seed=1)
        groups = groups or build_groups(spec.layout, rank, "cpu", model, list(spec.bounds))
        engines[name] = PipelineEngine(spec, model, rank, torch.device("cpu"), groups, spec.optim, spec.train,
                                       datetime.timedelta(seconds=300))
    generator = torch.Generator().manual_seed(rank)
    batches = {i: model.make_batch(micro, generator) for i in range(m)}
    buckets = {name: len(e.gradients.reduction.buckets) for name, e in engines.items()}
    return engines, {"batches": batches, "buckets": buckets,
                     "params": sum(p.numel() for p in engines["overlap"].params)}


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        engines, info = _engines(rank, args)
        times: dict[str, list[float]] = {name: [] for name in engines}
        for round_index in range(args.warmup + args.rounds):
            order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
            for name in order:
                dist.barrier()
                start = time.perf_counter()
                for _ in range(args.steps):
                    engines[name].train_step(info["batches"], grad_norm=False)
                if round_index >= args.warmup:
                    times[name].append((time.perf_counter() - start) / args.steps)
        return {"times": times, "buckets": info["buckets"], "params": info["params"]}
    finally:
        dist.destroy_process_group()


def markdown(result: dict) -> str:
    config, times = result["config"], result["rank0"]["times"]
    ratios = [a / b for a, b in zip(times["overlap"], times["at sync"])]
    lines = [f"Data-parallel step time, dp=2 (Gloo, CPU, 1 thread per process), GPT h={config['hidden']}, "
             f"{config['layers']} layers, s={config['seq']}, m={config['microbatches']} micro-batches of 4, "
             f"{result['rank0']['params']:,} parameters, buckets of {config['bucket_mb']} MiB; "
             f"{config['rounds']} rounds of {config['steps']} steps on a {config['cpus']}-core machine.", "",
             "| gradient reduction | buckets | step median (ms) | min-max (ms) |", "|---|---|---|---|"]
    for name in CASES:
        values = times[name]
        lines.append(f"| {name} | {result['rank0']['buckets'][name]} | {1e3 * statistics.median(values):.1f} | "
                     f"{1e3 * min(values):.1f}-{1e3 * max(values):.1f} |")
    lines += ["", f"Median per-round ratio overlap / at sync: {statistics.median(ratios):.3f}.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny model, few rounds; writes under --out-dir only")
    parser.add_argument("--out-dir", default=str(ROOT / "docs"))
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.seq, args.rounds, args.steps, args.warmup = 32, 2, 16, 2, 1, 1
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ranks = run_workers(_worker, 2, args, timeout=1200)
    config = {k: v for k, v in vars(args).items() if k not in ("out_dir", "quick")}
    result = {"config": config | {"dp": 2, "pp": 1, "backend": "gloo", "torch": torch.__version__,
                                  "cpus": os.cpu_count()},
              "rank0": ranks[0], "rank1": ranks[1]}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_dp_overlap.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "bench_dp_overlap.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
