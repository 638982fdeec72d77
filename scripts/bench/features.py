"""Training features against their baselines, on this machine: selective recomputation, sequence
parallelism, the distributed optimizer (and its ZeRO-2 and ZeRO-3 levels against ZeRO-1), context
parallelism (cp = 2 against cp = 1), compiled stages, and on a small Mixtral expert parallelism
(ep = 2 against ep = 1) and dualpipev's all-to-all hidden behind its paired forward and backward
(parallel.ep_overlap on against off, 4 processes). Each feature runs paired with its baseline
(same model, layout and steps, the order alternating between rounds, so both see the same phase of a shared machine); the
step-time ratio is taken within each round, then its median. Memory is each rank's peak RSS and the
bytes autograd stashes per micro-batch (the activation memory the features exist to cut), from the
runs' summary.json. Writes docs/bench_features.json and its section of docs/benchmarks.md.

Run: .venv/bin/python -m scripts.bench.features           (about 10 minutes on a 2-core machine)
     .venv/bin/python -m scripts.bench.features --quick   (tiny model, writes nothing under docs/)
     .venv/bin/python -m scripts.bench.features --only "expert parallelism" ...   (those rows, kept
         beside the others in docs/bench_features.json with their own date)
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts import ROOT
from scripts.bench.runtime_report import machine, replace_section
from tests.support.training_harness import train_rank
from tests.support.workers import run_workers

MODEL = ["model=gpt_tiny", "model.num_layers=4", "model.hidden_size=256", "model.num_heads=8", "model.seq_len=256",
         "model.tie_embeddings=false"]
QUICK_MODEL = ["model=gpt_tiny", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=2",
               "model.seq_len=16", "model.tie_embeddings=false"]
# the MoE rows: mixtral_tiny widened so that its experts' GEMMs, not Python, take most of a step
MOE_MODEL = ["model=mixtral_tiny", "model.hidden_size=256", "model.ffn_hidden_size=512", "model.num_heads=8",
             "model.num_kv_heads=4", "model.seq_len=128"]
QUICK_MOE_MODEL = ["model=mixtral_tiny", "model.seq_len=16"]
# The MoE rows reduce gradients after the backward: they compare expert layouts and the all-to-all's
# overlap, which the data-parallel reduction's own overlap would blur on two cores.
MOE_RUN = ("train.global_batch_size=16", "train.overlap_grad_reduce=false")
RUN = ["train.global_batch_size=8", "train.micro_batch_size=2", "train.eval_every=0", "train.eval_batches=1",
       "train.progress=false", "train.log_every=1000", "trace.enabled=false", "optim=adamw"]


@dataclass(frozen=True)
class Comparison:
    name: str
    layout: tuple[str, ...]      # the processes' layout, shared by both sides
    baseline: tuple[str, ...]
    feature: tuple[str, ...]
    what: str
    moe: bool = False            # the Mixtral model instead of the GPT one
    processes: int = 2


COMPARISONS = (
    Comparison("selective recomputation", ("parallel.pp=2", "schedule=1f1b"), ("recompute.granularity=none",),
               ("recompute.granularity=selective",), "attention cores recomputed in the backward"),
    Comparison("sequence parallelism", ("parallel.pp=1", "parallel.tp=2", "schedule=1f1b"),
               ("parallel.sequence_parallel=false",), ("parallel.sequence_parallel=true",),
               "tp = 2: LayerNorm/dropout regions on half the sequence"),
    Comparison("distributed optimizer", ("parallel.pp=1", "parallel.dp=2", "schedule=1f1b"), ("optim.distributed=false",),
               ("optim.distributed=true",), "dp = 2: AdamW state sharded over the two replicas"),
    Comparison("ZeRO-2", ("parallel.pp=1", "parallel.dp=2", "schedule=1f1b"), ("optim.distributed=zero1",),
               ("optim.distributed=zero2",), "dp = 2 against zero1: no gradient held between steps"),
    Comparison("ZeRO-3", ("parallel.pp=1", "parallel.dp=2", "schedule=1f1b"), ("optim.distributed=zero1",),
               ("optim.distributed=zero3",), "dp = 2 against zero1: parameters sharded at rest, gathered once per step"),
    Comparison("context parallelism", ("parallel.pp=1", "schedule=1f1b", "model.dropout=0"),
               ("parallel.cp=1", "parallel.dp=2"), ("parallel.cp=2", "parallel.dp=1"),
               "the same 2 processes and global batch: cp = 2 (each rank half of every sequence, K/V around "
               "the ring) against cp = 1 (dp = 2, each rank whole sequences)"),
    Comparison("compiled stages", ("parallel.pp=2", "schedule=1f1b"), ("train.compile=false",),
               ("train.compile=true",), "torch.compile (inductor) per layer; its compile time is excluded "
                                         "(the median step is after the warm-up steps)"),
    Comparison("expert parallelism", ("parallel.pp=1", "parallel.dp=2", "schedule=1f1b", *MOE_RUN),
               ("parallel.ep=1",), ("parallel.ep=2",),
               "the same 2 processes and global batch: ep = 2 (each rank 2 of the 4 experts, tokens exchanged by "
               "all-to-all) against ep = 1 (every rank all 4)", moe=True),
    Comparison("all-to-all overlap", ("parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "schedule=dualpipev",
                                      *MOE_RUN),
               ("parallel.ep_overlap=false",), ("parallel.ep_overlap=true",),
               "dualpipev, pp = 2 x dp = 2 with ep = 2, 4 processes: each forward run with the paired backward "
               "(a second thread) against one after the other", moe=True, processes=4),
)


def one_run(overrides: list[str], steps: int, run_dir: Path, processes: int = 2) -> dict[str, Any]:
    # fresh processes: peak RSS is a process's high-water mark, which a reused worker carries over
    per_rank = run_workers(train_rank, processes, [(overrides + [f"train.steps={steps}"], str(run_dir))], timeout=1800,
                           fresh=True)
    summary = per_rank[0][0]["summary"]
    ranks = summary["ranks"]
    return {"step_time_s": summary["median_step_time_s"],
            "peak_rss_bytes": [r["peak_memory_bytes"].get("rss", 0) for r in ranks],
            "stash_bytes_per_microbatch": [sum(r["stash_bytes_per_microbatch"].values()) for r in ranks],
            "optimizer_state_bytes": [r["optimizer_state_bytes"] for r in ranks],
            # parameters + gradients + optimizer state held between steps (summary.json's held_bytes)
            "held_at_rest_bytes": [sum(r["memory"]["held_bytes"]["rest"].values()) for r in ranks]}


def measure(comparison: Comparison, model: list[str], steps: int, rounds: int) -> dict[str, Any]:
    """``model``: the GPT overrides, or the Mixtral ones for a comparison of MoE features."""
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "feature": []}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(rounds):
            order = ("baseline", "feature") if index % 2 == 0 else ("feature", "baseline")
            for side in order:
                extra = comparison.baseline if side == "baseline" else comparison.feature
                overrides = model + RUN + list(comparison.layout) + list(extra)
                runs[side].append(one_run(overrides, steps, Path(tmp) / f"{side}-{index}", comparison.processes))
                print(comparison.name, side, runs[side][-1], flush=True)
    ratios = [f["step_time_s"] / b["step_time_s"] for b, f in zip(runs["baseline"], runs["feature"])]
    return {"paired_step_time_ratio": {"median": statistics.median(ratios), "range": [min(ratios), max(ratios)]},
            **{side: {"step_time_s": statistics.median(r["step_time_s"] for r in results),
                      "peak_rss_bytes": [statistics.median(r["peak_rss_bytes"][k] for r in results)
                                         for k in range(comparison.processes)],
                      "stash_bytes_per_microbatch": results[0]["stash_bytes_per_microbatch"],
                      "optimizer_state_bytes": results[0]["optimizer_state_bytes"],
                      "held_at_rest_bytes": results[0]["held_at_rest_bytes"]}
               for side, results in runs.items()}}


def markdown(data: dict[str, Any]) -> str:
    mib = 1024 ** 2
    lines = ["## Training features against their baselines (CPU)", "",
             f"Written by `python -m scripts.bench.features` on {data['date']} ({data['machine']['cpu']}, "
             f"{data['machine']['cores']} cores, torch {data['machine']['torch']}). GPT, {data['model']}; 2 processes "
             f"(Gloo, one thread each), global batch 8 in micro-batches of 2, AdamW, {data['steps']} steps, median "
             f"over {data['rounds']} paired runs. Stash: the bytes autograd keeps per micro-batch, summed over a "
             f"rank's chunks. Rows with their own date ran later (`--only`). The MoE rows train "
             f"{data.get('moe_model', 'a small Mixtral')}, global batch 16, on the processes their row names, "
             f"reducing gradients after the backward (the rows compare expert layouts and the all-to-all's "
             f"overlap, not the reduction's); memory columns list every rank.", "",
             "| feature | step time, baseline -> feature (ms) | feature / baseline (paired; range) | "
             "stash per micro-batch, rank 0 / 1 / ... (KiB) | optimizer state, per rank (KiB) | "
             "params + grads + state at rest, per rank (KiB) | peak RSS, per rank (MiB) |",
             "|---|---|---|---|---|---|---|"]
    for name, result in data["results"].items():
        base, feat, ratio = result["baseline"], result["feature"], result["paired_step_time_ratio"]
        stash = " / ".join(f"{b / 1024:.0f} -> {f / 1024:.0f}" for b, f in
                           zip(base["stash_bytes_per_microbatch"], feat["stash_bytes_per_microbatch"]))
        rss = " / ".join(f"{b / mib:.0f} -> {f / mib:.0f}" for b, f in zip(base["peak_rss_bytes"], feat["peak_rss_bytes"]))
        state = " / ".join(f"{b / 1024:.0f} -> {f / 1024:.0f}" for b, f in
                           zip(base["optimizer_state_bytes"], feat["optimizer_state_bytes"]))
        held = " / ".join(f"{b / 1024:.0f} -> {f / 1024:.0f}" for b, f in
                          zip(base["held_at_rest_bytes"], feat["held_at_rest_bytes"]))
        when = f"; {result['date']}" if result.get("date", data["date"]) != data["date"] else ""
        lines.append(f"| {name} ({result['what']}{when}) | {base['step_time_s'] * 1e3:.0f} -> {feat['step_time_s'] * 1e3:.0f} | "
                     f"{ratio['median']:.2f} ({ratio['range'][0]:.2f}-{ratio['range'][1]:.2f}) | {stash} | {state} | "
                     f"{held} | {rss} |")
    lines += ["", "What these measure on a CPU: torch's CPU attention is a fused kernel that keeps no s x s "
              "matrices, so selective recomputation has little to drop here and pays the cores' forward again "
              "(on a GPU with the math kernel it drops 5as/h of the layer's 34 + 5as/h bytes per element of sbh); "
              "Gloo has no reduce-scatter, so sequence parallelism runs an all-reduce and keeps a slice (more bytes "
              "than NCCL's reduce-scatter); inductor's CPU kernels for layers this small do not beat eager. The "
              "memory columns are what each feature is for: the stash with sequence parallelism, the optimizer "
              "state with the distributed optimizer, the bytes held between steps with ZeRO-2 (no gradients) and ZeRO-3 "
              "(a 1/dp shard of the parameters too), the stash with context parallelism (half the tokens of every "
              "micro-batch per rank). Expert parallelism: each rank holds half the experts (their parameters, "
              "gradients and AdamW state) and pays two all-to-alls each way per MoE layer. The all-to-all overlap "
              "row runs 4 processes on this machine's cores, whose threads (two per process while a pair runs) "
              "compete for them: the exchange waits it can hide are those a peer's compute causes."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=None, help="paired rounds per feature (default 3; 1 with --quick)")
    parser.add_argument("--only", nargs="+", choices=[c.name for c in COMPARISONS], default=None,
                        help="measure these comparisons only, keeping the others' results in bench_features.json")
    args = parser.parse_args()
    model, moe_model, steps, rounds = (QUICK_MODEL, QUICK_MOE_MODEL, 6, 1) if args.quick else (MODEL, MOE_MODEL, 16, 3)
    rounds = args.rounds or rounds
    out = args.out_dir or (None if args.quick else ROOT / "docs")
    today = datetime.date.today().isoformat()
    chosen = [c for c in COMPARISONS if args.only is None or c.name in args.only]
    results = {c.name: {"what": c.what, "date": today, **measure(c, moe_model if c.moe else model, steps, rounds)}
               for c in chosen}
    data = {"date": today, "machine": machine(), "steps": steps, "rounds": rounds,
            "model": "4 blocks, hidden 256, 8 heads, sequence 256" if not args.quick else "quick",
            "moe_model": "mixtral_tiny at hidden 256, expert FFN 512, 8 heads, sequence 128" if not args.quick
            else "quick", "results": results}
    earlier = out / "bench_features.json" if out is not None else None
    if args.only is not None and earlier is not None and earlier.exists():   # the other rows as measured before
        data = {**json.loads(earlier.read_text()), "moe_model": data["moe_model"]}
        data["results"] = {c.name: results.get(c.name, data["results"].get(c.name)) for c in COMPARISONS
                           if c.name in results or c.name in data["results"]}
    if out is not None:   # the measurements first: they survive a failure below
        (out / "bench_features.json").write_text(json.dumps(data, indent=1) + "\n")
    print(markdown(data))
    if out is not None:
        replace_section(out / "benchmarks.md", "bench_features", markdown(data))


if __name__ == "__main__":
    main()
