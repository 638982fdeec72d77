"""The training loop shared by every schedule: data, iterations, evaluation, logging, summary."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from tqdm import tqdm

from models import build_model

from .checkpoint import RunCheckpoints
from .data import GlobalBatchOrder, build_datasets, microbatches
from .distributed import DistContext
from .engine import PipelineEngine
from .groups import build_groups
from .metrics import (RunWriter, StepTimes, Throughput, check_tensorboard, model_flops_per_iteration,
                      peak_memory_bytes, warmup_steps)
from .peak_flops import PeakFlops, peak_flops
from .run_spec import RunSpec
from .tensor_parallel import TensorParallel
from .trace import TraceRecorder, gather_traces, traced_steps
from .trace_report import write_trace_outputs


@dataclass
class RankStats:
    rank: int
    pp_rank: int
    dp_rank: int
    peak_in_flight: int
    peak_stash_bytes: int
    stash_bytes_per_microbatch: dict[int, int]
    weight_versions: int
    bytes_sent: int                 # whole run, evaluation included
    bytes_received: int
    comm: dict[str, float]          # per training step: bytes, receive waits, send posts, gradient sync
    peak_memory_bytes: dict[str, int]
    bubble_fraction: float | None = None   # measured in traced iterations (filled on rank 0)


def agree_on_run_dir(cfg: Any, ctx: DistContext) -> Path:
    """Rank 0 resolves the run directory (it may hold a timestamp) and tells the others."""
    holder = [str(cfg.train.run_dir) if ctx.rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return Path(holder[0])


def _shard_batches(dataset, order: GlobalBatchOrder, step: int, spec: RunSpec, dp_rank: int):
    indices = order.shard(step, dp_rank, spec.layout.dp)
    return dict(enumerate(microbatches(dataset, indices, spec.micro_batch)))


@dataclass
class TrainOutcome:
    summary: dict[str, Any]
    engine: PipelineEngine


def _comm_bytes(engine: PipelineEngine) -> tuple[int, int]:
    stats = engine.comm.stats if engine.comm is not None else None
    return (stats.bytes_sent, stats.bytes_received) if stats is not None else (0, 0)


def _throughput(cfg: Any, spec: RunSpec, ctx: DistContext) -> tuple[Throughput, PeakFlops | None]:
    """Only rank 0 logs, so only rank 0 looks up (or measures once, then caches) the peak."""
    peak = peak_flops(ctx.device, torch.get_num_threads()) if ctx.rank == 0 else None
    flops = model_flops_per_iteration(cfg.model, spec.global_batch, spec.seq_len, spec.recompute)
    return Throughput(spec.global_batch, spec.seq_len or 1, flops, ctx.world_size, peak.flops if peak else 0.0), peak


def train(cfg: Any, spec: RunSpec, ctx: DistContext) -> TrainOutcome:
    logging_cfg = cfg.get("logging") or {}
    check_tensorboard(bool(logging_cfg.get("tensorboard", False)))
    seed = int(cfg.train.seed)
    torch.manual_seed(seed)
    dense = build_model(cfg.model, seed=seed)
    groups = build_groups(spec.layout, ctx.rank, ctx.device.type, dense, list(spec.bounds))
    tp = TensorParallel.from_group(groups.tp) if spec.layout.tp > 1 else None
    model = build_model(cfg.model, seed=seed, tp=tp) if tp is not None else dense
    recorder = TraceRecorder()
    engine = PipelineEngine(spec, model, ctx.rank, ctx.device, groups, cfg.optim, cfg.train, ctx.timeout,
                            recorder=recorder, tp=tp, shape_model=dense)
    train_set, val_set = build_datasets(cfg.model, cfg.data, seed)
    order = GlobalBatchOrder(len(train_set), spec.global_batch, seed)
    val_steps = max(1, min(int(cfg.train.eval_batches), len(val_set) // spec.global_batch))
    val_order = GlobalBatchOrder(len(val_set), spec.global_batch, seed)
    dp_rank = engine.coords.dp

    run_dir = agree_on_run_dir(cfg, ctx)
    writer = RunWriter(run_dir, bool(logging_cfg.get("tensorboard", False))) if ctx.rank == 0 else None
    if writer:
        resolved = OmegaConf.to_container(cfg, resolve=True)   # the run as it ran (timestamp included)
        resolved["train"]["run_dir"] = str(run_dir)
        writer.write_config(OmegaConf.to_yaml(OmegaConf.create(resolved)))
    steps = int(cfg.train.steps)
    log_every = max(1, int(cfg.train.log_every))
    eval_every = int(cfg.train.eval_every)
    times = StepTimes()
    throughput, peak = _throughput(cfg, spec, ctx)
    to_trace = traced_steps(cfg.get("trace"), steps, warmup_steps(steps))
    train_bytes = [0, 0]
    progress = tqdm(total=steps, desc="train", disable=ctx.rank != 0 or not cfg.train.progress, dynamic_ncols=True)

    def evaluate() -> float:
        losses = [engine.evaluate(_shard_batches(val_set, val_order, i, spec, dp_rank)) for i in range(val_steps)]
        return sum(losses) / len(losses)

    checkpoints = RunCheckpoints(cfg, engine, ctx.rank, run_dir)
    start_step = checkpoints.resume()
    progress.update(start_step)
    last_loss, val_loss = math.nan, math.nan
    for step in range(start_step, steps):
        batches = _shard_batches(train_set, order, step, spec, dp_rank)
        traced = step + 1 in to_trace
        recorder.begin_step(step + 1, traced, dist.barrier if traced else None)
        sent, received = _comm_bytes(engine)
        evaluating = eval_every > 0 and ((step + 1) % eval_every == 0 or step + 1 == steps)
        logged = (step + 1) % log_every == 0 or step + 1 == steps or evaluating
        started = time.perf_counter()
        result = engine.train_step(batches, grad_norm=logged)
        elapsed = time.perf_counter() - started
        recorder.end_step()
        train_bytes[0] += _comm_bytes(engine)[0] - sent
        train_bytes[1] += _comm_bytes(engine)[1] - received
        times.add(elapsed)
        last_loss = result.loss
        progress.update(1)
        record = {"step": step + 1, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
                  "step_time_s": elapsed, **throughput.of(elapsed)}
        if evaluating:
            val_loss = evaluate()
            record["val_loss"] = val_loss
        if writer and logged:
            writer.log_step(record)
            progress.set_postfix(loss=f"{result.loss:.3f}", **({"val": f"{val_loss:.3f}"} if "val_loss" in record else {}))
            progress.write(_format_record(record, steps))
        checkpoints.after_step(step + 1)
    progress.close()
    engine.drain()  # asynchronous schedules: final weights well defined (the last step has already drained)
    if math.isnan(val_loss):
        val_loss = evaluate()

    stats = RankStats(rank=ctx.rank, pp_rank=engine.coords.pp, dp_rank=dp_rank,
                      peak_in_flight=engine.stage.stats.peak_in_flight,
                      peak_stash_bytes=engine.stage.stats.peak_bytes,
                      stash_bytes_per_microbatch=dict(engine.stage.stats.bytes_per_microbatch),
                      weight_versions=engine.weight_versions,
                      bytes_sent=_comm_bytes(engine)[0], bytes_received=_comm_bytes(engine)[1],
                      comm={"bytes_sent_per_step": train_bytes[0] / steps,
                            "bytes_received_per_step": train_bytes[1] / steps, **recorder.totals.per_step()},
                      peak_memory_bytes=peak_memory_bytes(ctx.device))
    gathered: list[RankStats | None] = [None] * ctx.world_size
    dist.all_gather_object(gathered, stats)
    traces = gather_traces(recorder, ctx.rank, engine.coords.pp, dp_rank, ctx.world_size)
    report = None
    if traces is not None:
        report = write_trace_outputs(run_dir / "trace", traces, spec.schedule, spec.layout.pp, spec.microbatches,
                                     spec.layout.vpp, draw=bool((cfg.get("trace") or {}).get("timeline", True)),
                                     metadata={"schedule": spec.schedule, "run_dir": str(run_dir)},
                                     weight_grads_delay=int(cfg.train.get("weight_grads_delay", 1)))
        if report is not None:
            for rank_stats, bubble in zip(gathered, report.bubble_fraction_per_rank):
                rank_stats.bubble_fraction = bubble
    median = times.median_after_warmup()
    summary = {
        "steps": steps,
        "schedule": spec.schedule,
        "parallel": {"pp": spec.layout.pp, "dp": spec.layout.dp, "tp": spec.layout.tp, "vpp": spec.layout.vpp},
        "batch": {"global": spec.global_batch, "micro": spec.micro_batch, "num_microbatches": spec.microbatches},
        "stages": [list(b) for b in spec.bounds],
        "median_step_time_s": median,
        **throughput.of(median),
        "model_flops_per_iteration": throughput.flops_per_iteration,
        "peak_flops_per_device": vars(peak) if peak else None,
        "bubble_fraction": (sum(report.bubble_fraction_per_rank) / len(report.bubble_fraction_per_rank)
                            if report else None),
        "trace": report.as_dict() if report else None,
        "final_train_loss": last_loss,
        "final_val_loss": val_loss,
        "ranks": [vars(s) for s in gathered],
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    if writer:
        summary["config"]["train"]["run_dir"] = str(run_dir)
        path = writer.write_summary(summary)
        writer.close()
        print(f"final train loss {last_loss:.4f}, validation loss {val_loss:.4f}, "
              f"{summary['samples_per_s']:.1f} samples/s; wrote {path}", flush=True)
    return TrainOutcome(summary, engine)


def _format_record(record: dict[str, Any], steps: int) -> str:
    text = (f"step {record['step']:>5}/{steps}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
            f"step {record['step_time_s'] * 1000:.0f} ms  {record['samples_per_s']:.1f} samples/s  "
            f"{record['tokens_per_s']:.0f} tokens/s  MFU {record['mfu']:.1%}")
    if "val_loss" in record:
        text += f"  val_loss {record['val_loss']:.4f}"
    return text
