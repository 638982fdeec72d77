"""Mixed-precision benchmark: the same 2-stage GPT trained by the real trainer (1f1b, Gloo, one
thread per process) in fp32 and in bf16: median step time, peak memory, the bytes autograd stashes
per micro-batch, and the point-to-point bytes per step, all from the runs' summary.json. Writes
docs/bench_precision.json and its section of docs/benchmarks.md (every number measured here).

Run: .venv/bin/python -m scripts.bench.precision           (about 2 minutes on a 2-core machine)
     .venv/bin/python -m scripts.bench.precision --quick   (tiny model, writes nothing under docs/)

Each round runs fp32 and bf16 back to back (the order alternating between rounds), so both see the
same phase of a shared machine; the step-time ratio is taken within each round, then its median.
Other cells are medians over the rounds (bytes are the same in every round).
"""
from __future__ import annotations

import argparse
import datetime
import json
import resource
import statistics
import tempfile
from pathlib import Path
from typing import Any

from scripts import ROOT
from scripts.bench.load import cpu_busy_jiffies, other_load
from scripts.bench.runtime_report import machine, replace_section
from tests.support.training_harness import train_rank
from tests.support.workers import run_workers

PRECISIONS = ("fp32", "bf16")
MODEL = ["model=gpt_tiny", "model.num_layers=4", "model.hidden_size=256", "model.num_heads=4", "model.seq_len=64",
         "model.tie_embeddings=false"]
QUICK_MODEL = ["model=gpt_tiny", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=2",
               "model.seq_len=16", "model.tie_embeddings=false"]
RUN = ["parallel.pp=2", "schedule=1f1b", "train.global_batch_size=16", "train.micro_batch_size=2",
       "train.eval_every=0", "train.eval_batches=1", "train.progress=false", "train.log_every=1000",
       "trace.enabled=false", "optim=adamw"]


def one_run(precision: str, model: list[str], steps: int, run_dir: Path) -> dict[str, Any]:
    overrides = model + RUN + [f"train.steps={steps}", f"precision={precision}"]
    jiffies, children = cpu_busy_jiffies(), resource.getrusage(resource.RUSAGE_CHILDREN)
    per_rank = run_workers(train_rank, 2, [(overrides, str(run_dir))], timeout=900)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    own_cpu_s = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime   # both ranks'
    load = other_load(jiffies, cpu_busy_jiffies(), own_cpu_s)
    summary = per_rank[0][0]["summary"]
    ranks = summary["ranks"]
    return {"step_time_s": summary["median_step_time_s"], "other_load": load if load is not None else float("nan"),
            "peak_rss_bytes": [r["peak_memory_bytes"].get("rss", 0) for r in ranks],
            "stash_bytes_per_microbatch": [sum(r["stash_bytes_per_microbatch"].values()) for r in ranks],
            "p2p_bytes_sent_per_step": [r["comm"]["bytes_sent_per_step"] for r in ranks]}


def measure(model: list[str], steps: int, rounds: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PRECISIONS}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(rounds):
            order = PRECISIONS if index % 2 == 0 else tuple(reversed(PRECISIONS))
            for precision in order:
                runs[precision].append(one_run(precision, model, steps, Path(tmp) / f"{precision}-{index}"))
                print(precision, runs[precision][-1], flush=True)
    ratios = [b["step_time_s"] / a["step_time_s"] for a, b in zip(runs["fp32"], runs["bf16"])]
    return {"paired_step_time_ratio": {"median": statistics.median(ratios), "range": [min(ratios), max(ratios)]},
            **{precision: {"step_time_s": statistics.median(r["step_time_s"] for r in results),
                        "step_time_range_s": [min(r["step_time_s"] for r in results),
                                              max(r["step_time_s"] for r in results)],
                        "other_load": [r["other_load"] for r in results],
                        "peak_rss_bytes": [statistics.median(r["peak_rss_bytes"][k] for r in results) for k in (0, 1)],
                        "stash_bytes_per_microbatch": results[0]["stash_bytes_per_microbatch"],
                        "p2p_bytes_sent_per_step": results[0]["p2p_bytes_sent_per_step"]}
               for precision, results in runs.items()}}


def bf16_flags() -> list[str]:
    """The CPU's bf16 instruction flags (/proc/cpuinfo), which decide what bf16 GEMMs gain."""
    try:
        words = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return sorted(w for w in words if w in ("avx512_bf16", "amx_bf16", "amx_tile", "avx_vnni"))


def markdown(data: dict[str, Any]) -> str:
    fp32, bf16 = data["results"]["fp32"], data["results"]["bf16"]
    mib = 1024 ** 2
    loads = "; ".join(f"{name} runs " + ", ".join(f"{100 * v:.0f}%" for v in runs["other_load"])
                      for name, runs in (("fp32", fp32), ("bf16", bf16)))
    lines = ["## Mixed precision: bf16 vs fp32 (CPU)", "",
             f"Written by `python -m scripts.bench.precision` on {data['date']} ({data['machine']['cpu']}, "
             f"{data['machine']['cores']} cores, torch {data['machine']['torch']}); the machine was shared with other "
             f"work while it ran (other processes' share of the CPU during the runs: {loads}), so step "
             f"times are indicative. GPT, {data['model']}; 2 stages (1f1b, Gloo), global "
             f"batch 16 in micro-batches of 2, AdamW, {data['steps']} steps, median over {data['rounds']} runs each.",
             "", "| | fp32 | bf16 | bf16 / fp32 |", "|---|---|---|---|"]

    def row(label: str, a: float, b: float, unit: float = 1.0, fmt: str = "{:.1f}") -> None:
        lines.append(f"| {label} | {fmt.format(a / unit)} | {fmt.format(b / unit)} | {b / a:.2f} |")

    ratio = data["results"]["paired_step_time_ratio"]
    lines.append(f"| median step time (ms; min-max over runs) | {fp32['step_time_s'] * 1e3:.0f} "
                 f"({fp32['step_time_range_s'][0] * 1e3:.0f}-{fp32['step_time_range_s'][1] * 1e3:.0f}) | "
                 f"{bf16['step_time_s'] * 1e3:.0f} ({bf16['step_time_range_s'][0] * 1e3:.0f}-"
                 f"{bf16['step_time_range_s'][1] * 1e3:.0f}) | {ratio['median']:.2f} (paired per round; "
                 f"{ratio['range'][0]:.2f}-{ratio['range'][1]:.2f}) |")
    for stage in (0, 1):
        row(f"peak RSS, stage {stage} (MiB)", fp32["peak_rss_bytes"][stage], bf16["peak_rss_bytes"][stage], mib)
    for stage in (0, 1):
        row(f"autograd stash per micro-batch, stage {stage} (KiB)", fp32["stash_bytes_per_microbatch"][stage],
            bf16["stash_bytes_per_microbatch"][stage], 1024)
    for stage in (0, 1):
        row(f"point-to-point bytes sent per step, stage {stage} (KiB)", fp32["p2p_bytes_sent_per_step"][stage],
            bf16["p2p_bytes_sent_per_step"][stage], 1024)
    flags = ", ".join(data["machine"]["bf16_cpu_flags"]) or "none"
    lines += ["", f"What limits bf16 on a CPU: its GEMM speed depends on the CPU's bf16 instructions (this one's "
              f"bf16 flags: {flags}; AMX tiles are where CPUs gain most), autocast casts every weight per forward, "
              "and the element-wise work (LayerNorm, GELU, softmax, the casts) is memory-bound at tiny sizes. What "
              "bf16 saves for certain is bytes: boundary tensors and their gradients exactly half, the autograd "
              "stash about half. Peak RSS is dominated by the interpreter, torch and the fp32 parameters, gradients and Adam "
              "state, which mixed precision keeps in fp32 (docs/design.md, Mixed precision). On a GPU with tensor "
              "cores the same run computes at the bf16 peak (`pipedream/devices.py`)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    model, steps, rounds = (QUICK_MODEL, 4, 1) if args.quick else (MODEL, 12, 3)
    data = {"date": datetime.date.today().isoformat(), "machine": {**machine(), "bf16_cpu_flags": bf16_flags()},
            "steps": steps, "rounds": rounds,
            "model": "4 blocks, hidden 256, 4 heads, sequence 64" if not args.quick else "quick",
            "results": measure(model, steps, rounds)}
    out = args.out_dir or (None if args.quick else ROOT / "docs")
    if out is not None:   # the measurements first: they survive a failure below
        (out / "bench_precision.json").write_text(json.dumps(data, indent=1) + "\n")
    print(markdown(data))
    if out is not None:
        replace_section(out / "benchmarks.md", "bench_precision", markdown(data))


if __name__ == "__main__":
    main()
