"""The training loop shared by every schedule: data, iterations, evaluation, logging, summary."""
from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from tqdm import tqdm

from models import build_model
from models.context_parallel import ContextParallel
from models.expert_parallel import ExpertParallel

from pipedream.checkpoint.memory_folders import clear_all
from pipedream.checkpoint.peer_copies import PeerCopies
from pipedream.checkpoint.store import RunCheckpoints
from pipedream.data.context_shard import context_shard
from pipedream.data.datasets import build_datasets
from pipedream.data.batching import GlobalBatchOrder, microbatches
from pipedream.observe.device_clock import clock_for
from pipedream.runtime.distributed import DistContext
from pipedream.runtime.engine import PipelineEngine, StepResult
from pipedream.runtime.engine_protocol import Engine
from pipedream.runtime.groups import build_groups
from pipedream.multi_model.fused import build_fused_model
from pipedream.runtime.fused_training import StackedData
from pipedream.observe.metrics import (RunWriter, StepTimes, Throughput, check_tensorboard, format_step_line,
                                       model_flops_per_iteration, peak_memory_bytes, progress_bar_wanted, warmup_steps)
from pipedream.observe.peak_flops import PeakFlops, peak_flops
from pipedream.numerics.optim import optimizer_state_bytes
from pipedream.lifecycle.preemption_watch import PreemptionWatch
from pipedream.lifecycle.elastic_run import ElasticRun, ReformRequested
from pipedream.config.elastic import ElasticSpec
from pipedream.config.run_spec import RunSpec
from models.tensor_parallel import TensorParallel
from pipedream.observe.trace import TraceRecorder, gather_traces, traced_steps
from pipedream.observe.trace_report import TraceReport, write_trace_outputs


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
    optimizer_state_bytes: int      # this rank's optimizer state (its shard with optim.distributed)
    bubble_fraction: float | None = None   # measured in traced iterations (filled on rank 0)
    memory: dict[str, Any] | None = None   # memory_virtualised: device budget, peak resident bytes, swap volume
    cpu_affinity: list[int] | None = None   # the cores this rank may run on (launcher.bind_cores)
    intra_op_threads: int | None = None


@dataclass
class TrainOutcome:
    summary: dict[str, Any]
    engine: Engine


def agree_on_run_dir(spec: RunSpec, ctx: DistContext) -> Path:
    """Rank 0 resolves the run directory (it may hold a timestamp) and tells the others."""
    holder = [spec.loop.run_dir if ctx.rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return Path(holder[0])


def resolved_config(spec: RunSpec, run_dir: Path) -> dict[str, Any]:
    """The run as it ran, for run_dir/config.yaml, checkpoints and the summary (timestamp included)."""
    resolved = copy.deepcopy(spec.config)
    resolved["train"]["run_dir"] = str(run_dir)
    return resolved


def _build_engine(spec: RunSpec, ctx: DistContext, recorder: TraceRecorder) -> Engine:
    """This rank's stages; with tensor parallelism its slice of them (boundary shapes stay dense),
    with context parallelism the layers that take its part of every sequence (boundary shapes: the
    dense model's on that shorter sequence), with expert parallelism its experts only (shapes: the
    dense model's, which holds every expert and exchanges nothing)."""
    torch.manual_seed(spec.train.seed)
    dense = (build_fused_model(spec.model_config, spec.multi_model) if spec.multi_model
             else build_model(spec.model_config, seed=spec.train.seed))
    if spec.harmony is not None:
        from pipedream.harmony.engine import HarmonyEngine
        return HarmonyEngine(spec, dense, ctx.rank, ctx.device, spec.optim, spec.train, ctx.timeout, recorder)
    pairs = spec.ep_overlap and ctx.device.type == "cpu"   # pairs run on Gloo (runtime.paired_compute)
    if spec.ep_overlap and not pairs and ctx.rank == 0:
        print(f"parallel.ep_overlap: forward/backward pairs run together on cpu (Gloo) only; on "
              f"{ctx.device.type} they run one after the other", flush=True)
    groups = build_groups(spec.layout, ctx.rank, ctx.device.type, dense, list(spec.bounds), ep_backward=pairs)
    tp = TensorParallel.from_group(groups.tp, spec.sequence_parallel) if spec.layout.tp > 1 else None
    cp = ContextParallel.from_group(groups.cp) if groups.cp is not None else None
    ep = ExpertParallel.from_group(groups.ep, backward_group=groups.ep_backward) if groups.ep is not None else None
    model = build_model(spec.model_config, seed=spec.train.seed, tp=tp, cp=cp, ep=ep) if tp or cp or ep else dense
    # boundary tensors are dense, except with sequence parallelism: this rank's part of the sequence
    return PipelineEngine(spec, model, ctx.rank, ctx.device, groups, spec.optim, spec.train, ctx.timeout,
                          recorder=recorder, tp=tp, shape_model=model if spec.sequence_parallel else dense)


class ShardedData:
    """The training and validation sets, and this data-parallel rank's micro-batches of a step
    (with context parallelism, of its part of every sequence)."""

    def __init__(self, spec: RunSpec, dp_rank: int, cp_rank: int = 0):
        seed = spec.train.seed
        self.spec, self.dp_rank = spec, dp_rank
        train_set, val_set = build_datasets(spec.model_config, spec.data_config, seed)
        cp = spec.layout.cp
        self.train_set, self.val_set = context_shard(train_set, cp, cp_rank), context_shard(val_set, cp, cp_rank)
        self.order = GlobalBatchOrder(len(self.train_set), spec.global_batch, seed)
        self.val_order = GlobalBatchOrder(len(self.val_set), spec.global_batch, seed)
        self.val_steps = max(1, min(spec.loop.eval_batches, len(self.val_set) // spec.global_batch))

    def train_batches(self, step: int) -> dict[int, Any]:
        return self._shard(self.train_set, self.order, step)

    def val_batches(self, index: int) -> dict[int, Any]:
        return self._shard(self.val_set, self.val_order, index)

    def _shard(self, dataset, order: GlobalBatchOrder, step: int) -> dict[int, Any]:
        indices = order.shard(step, self.dp_rank, self.spec.layout.dp)
        return dict(enumerate(microbatches(dataset, indices, self.spec.micro_batch)))


def _throughput(spec: RunSpec, ctx: DistContext) -> tuple[Throughput, PeakFlops | None]:
    """Only rank 0 logs, so only rank 0 looks up (or measures once, then caches) the peak."""
    peak = peak_flops(ctx.device, torch.get_num_threads(), precision=spec.precision.name) if ctx.rank == 0 else None
    recomputes_all = spec.recompute.full and spec.recompute.num_layers is None   # recompute.num_layers: model FLOPs only
    flops = model_flops_per_iteration(spec.model_config, spec.global_batch, spec.seq_len, recomputes_all,
                                      spec.plugin_forward_flops)
    return Throughput(spec.global_batch, spec.seq_len, flops, ctx.world_size, peak.flops if peak else 0.0), peak


@dataclass
class Loop:
    """State of the step loop: what it measured, and the last losses."""

    engine: Engine
    data: ShardedData | StackedData
    recorder: TraceRecorder
    times: StepTimes = field(default_factory=StepTimes)
    train_bytes: list[int] = field(default_factory=lambda: [0, 0])
    last_loss: float = math.nan
    steps_done: int = 0
    val_loss: float = math.nan
    models: list[dict[str, float]] | None = None   # a fused model set: each model's last record
    model_totals: dict[str, int] = field(default_factory=dict)   # model statistics' counters over the run

    def evaluate(self) -> float:
        losses = [self.engine.evaluate(self.data.val_batches(i)) for i in range(self.data.val_steps)]
        self.val_loss = sum(losses) / len(losses)
        if self.models is not None:
            for record, val_loss in zip(self.models, self.engine.model_val_losses()):
                record["val_loss"] = val_loss
        return self.val_loss

    def add_model_statistics(self, record: dict[str, Any]) -> None:
        """Adds the model's statistics to a logged step's record; counts that drop tokens add up to
        the summary's totals."""
        statistics = self.engine.model_statistics()
        record.update(statistics)
        if "moe_tokens_dropped" in statistics:
            self.model_totals["moe_tokens_dropped"] = (self.model_totals.get("moe_tokens_dropped", 0)
                                                       + statistics["moe_tokens_dropped"])

    def step(self, step: int, traced: bool, grad_norm: bool) -> tuple[StepResult, float]:
        """Runs 1-based ``step``; returns its result and time."""
        batches = self.data.train_batches(step - 1)
        self.recorder.begin_step(step, traced, dist.barrier if traced else None)
        sent, received = self.engine.comm_bytes()
        started = time.perf_counter()
        result = self.engine.train_step(batches, grad_norm=grad_norm)
        elapsed = time.perf_counter() - started
        self.recorder.end_step()
        self.train_bytes[0] += self.engine.comm_bytes()[0] - sent
        self.train_bytes[1] += self.engine.comm_bytes()[1] - received
        self.times.add(elapsed)
        self.last_loss = result.loss
        self.steps_done = step
        self.models = result.models
        return result, elapsed


def _run_steps(loop: Loop, spec: RunSpec, ctx: DistContext, checkpoints: RunCheckpoints, writer: RunWriter | None,
               throughput: Throughput, preemption: PreemptionWatch, elastic: ElasticRun,
               peers: PeerCopies | None = None) -> int | None:
    """Runs the remaining steps; returns the step after which a preemption stopped the run, else None
    (an elastic run asked to re-form raises ReformRequested once its checkpoint is saved)."""
    steps, log_every, eval_every = spec.train.steps, spec.loop.log_every, spec.loop.eval_every
    to_trace = traced_steps(spec.trace, steps, warmup_steps(steps))
    # closed on an error too, so the error line starts on a line of its own; off in a pipe or a log file
    bar = progress_bar_wanted(spec.loop.progress, ctx.rank, sys.stderr)
    with tqdm(total=steps, desc="train", disable=not bar, file=sys.stderr, dynamic_ncols=True) as progress:
        if peers is not None and checkpoints.resume_from:   # a snapshot newer than the disk's, held in memory
            peers.recover(checkpoints.root, checkpoints.extra)
        start_step = loop.steps_done = checkpoints.resume()
        elastic.started(start_step)
        progress.update(start_step)
        for step in range(start_step + 1, steps + 1):
            evaluating = eval_every > 0 and (step % eval_every == 0 or step == steps)
            logged = step % log_every == 0 or step == steps or evaluating
            result, elapsed = loop.step(step, step in to_trace, grad_norm=logged)
            progress.update(1)
            record = {"step": step, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
                      "step_time_s": elapsed, **throughput.of(elapsed)}
            scaler = loop.engine.loss_scaler
            if scaler is not None:   # fp16: the scale after this step and the steps skipped so far
                record.update(loss_scale=scaler.scale, skipped_steps=scaler.skipped_steps)
            if logged:   # collective: the model's layer statistics (MoE routing) since the last logged step
                loop.add_model_statistics(record)
            if evaluating:
                record["val_loss"] = loop.evaluate()
            if loop.models is not None:
                record["models"] = loop.models
            if elastic.enabled:   # which layout ran this step
                record["layout"] = elastic.layout
            if writer and logged:
                writer.log_step(record)
                progress.set_postfix(loss=f"{result.loss:.3f}",
                                     **({"val": f"{loop.val_loss:.3f}"} if "val_loss" in record else {}))
                progress.write(format_step_line(record, steps), file=sys.stdout)
                sys.stdout.flush()   # a line at a time in a pipe or a log too
            checkpoints.after_step(step)
            if peers is not None:
                peers.after_step(step)
            elastic.step_done(step)
            if step < steps and elastic.enabled and elastic.reform_requested():
                checkpoints.save(step)
                elastic.reform(step)
            if step < steps and preemption.requested():
                preemption.stop(step, checkpoints)
                return step
    checkpoints.finished(steps, start_step)
    return None


def train(spec: RunSpec, ctx: DistContext) -> TrainOutcome:
    """Trains on this rank; every setting comes from ``spec`` (the model and data sections, and the
    record of the run, as ``spec.config``)."""
    check_tensorboard(spec.loop.tensorboard)
    recorder = TraceRecorder(clock_for(ctx.device))   # the executor times its actions with it too
    engine = _build_engine(spec, ctx, recorder)
    data = StackedData(spec, engine.coords.dp, ShardedData) if spec.multi_model else \
        ShardedData(spec, engine.coords.dp, engine.coords.cp)
    loop = Loop(engine, data, recorder)
    run_dir = agree_on_run_dir(spec, ctx)
    config = resolved_config(spec, run_dir)
    writer = RunWriter(run_dir, spec.loop.tensorboard) if ctx.rank == 0 else None
    if writer:
        writer.write_config(OmegaConf.to_yaml(config))   # the plain record, in Hydra's YAML layout
    throughput, peak = _throughput(spec, ctx)
    checkpoints = RunCheckpoints(spec.checkpoint, _checkpoint_record(spec, config), engine, ctx.rank, run_dir)
    preemption = PreemptionWatch(spec.preemption, ctx, run_dir)
    elastic = ElasticRun(ElasticSpec.from_config(spec.config).enabled, run_dir, ctx.rank, ctx.world_size,
                         {"pp": spec.layout.pp, "tp": spec.layout.tp, "cp": spec.layout.cp, "dp": spec.layout.dp},
                         ctx.timeout)
    try:
        stopped_after = _run_steps(loop, spec, ctx, checkpoints, writer, throughput, preemption, elastic,
                                   _peer_copies(spec, ctx, checkpoints, run_dir))
    except Exception as error:
        if not isinstance(error, ReformRequested):
            elastic.failed(loop.steps_done)   # the record of when, and after which step, the world broke
        raise
    finally:
        preemption.close()
    if stopped_after is not None:   # no evaluation or summary: the requeued run finishes them
        if writer:
            writer.close()
        return TrainOutcome({"preempted_after_step": stopped_after}, engine)
    engine.drain()  # asynchronous schedules: final weights well defined (the last step has already drained)
    if math.isnan(loop.val_loss):
        loop.evaluate()
    gathered, report = _gather_stats(loop, spec, ctx, run_dir)
    if ctx.rank == 0:   # every rank is past its last step: the in-memory copies are no longer needed
        clear_all(run_dir)
    fused_stages = None   # a fused model set: each rank's fusion timings and feature-map memory
    fusion = engine.fusion_report()
    if fusion is not None:
        fused_stages = [None] * ctx.world_size
        dist.all_gather_object(fused_stages, fusion)
    summary = {**_summary(loop, spec, throughput, peak, gathered, report, config, fused_stages),
               **elastic.summary(spec.train.steps)}   # elastic: layouts and recoveries
    if writer:
        path = writer.write_summary(summary)
        writer.close()
        print(f"final train loss {loop.last_loss:.4f}, validation loss {loop.val_loss:.4f}, "
              f"{summary['samples_per_s']:.1f} samples/s; wrote {path}", flush=True)
    return TrainOutcome(summary, engine)


def _peer_copies(spec: RunSpec, ctx: DistContext, checkpoints: RunCheckpoints, run_dir: Path) -> PeerCopies | None:
    """checkpoint.in_memory_every > 0: this rank's copies in host memory (pipedream/checkpoint/peer_copies.py)."""
    every = int(spec.config["checkpoint"].get("in_memory_every") or 0)
    if every <= 0:
        return None
    group = dist.new_group(backend="gloo", timeout=ctx.timeout) if ctx.world_size > 1 else None
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
    return PeerCopies(every, run_dir, ctx.rank, ctx.world_size, local_world, checkpoints.module, checkpoints.engine,
                      group)


def _checkpoint_record(spec: RunSpec, config: dict[str, Any]) -> dict[str, Any]:
    """Stored beside each checkpoint: the resolved config and, if any, the plan it ran."""
    record: dict[str, Any] = {"config": config}
    if spec.plan and Path(spec.plan).exists():
        record["plan"] = json.loads(Path(spec.plan).read_text())
    return record


def _gather_stats(loop: Loop, spec: RunSpec, ctx: DistContext, run_dir: Path
                  ) -> tuple[list[RankStats], TraceReport | None]:
    """Collective: every rank's statistics and traces; rank 0 writes the trace outputs."""
    engine, steps = loop.engine, spec.train.steps
    stage_stats = engine.stash_stats
    stats = RankStats(rank=ctx.rank, pp_rank=engine.coords.pp, dp_rank=engine.coords.dp,
                      peak_in_flight=stage_stats.peak_in_flight, peak_stash_bytes=stage_stats.peak_bytes,
                      stash_bytes_per_microbatch=dict(stage_stats.bytes_per_microbatch),
                      weight_versions=engine.weight_versions,
                      bytes_sent=engine.comm_bytes()[0], bytes_received=engine.comm_bytes()[1],
                      comm={"bytes_sent_per_step": loop.train_bytes[0] / steps,
                            "bytes_received_per_step": loop.train_bytes[1] / steps, **loop.recorder.totals.per_step(),
                            **engine.all_to_all()},
                      peak_memory_bytes=peak_memory_bytes(ctx.device),
                      optimizer_state_bytes=optimizer_state_bytes(engine.optimizer),
                      memory=engine.memory_report(), cpu_affinity=sorted(os.sched_getaffinity(0)),
                      intra_op_threads=torch.get_num_threads())
    gathered: list[RankStats | None] = [None] * ctx.world_size
    dist.all_gather_object(gathered, stats)
    traces = gather_traces(loop.recorder, ctx.rank, engine.coords.pp, engine.coords.dp, ctx.world_size)
    report = None
    if traces is not None:
        report = write_trace_outputs(run_dir / "trace", traces, spec.schedule.name, spec.layout.pp, spec.microbatches,
                                     spec.layout.vpp, draw=spec.trace.timeline,
                                     metadata={"schedule": spec.schedule.name, "run_dir": str(run_dir)},
                                     weight_grads_delay=spec.train.weight_grads_delay,
                                     degrees=spec.layout.degrees(),
                                     rank_names={r: spec.layout.rank_label(r) for r in range(ctx.world_size)})
        if report is not None:
            for rank_stats, bubble in zip(gathered, report.bubble_fraction_per_rank):
                rank_stats.bubble_fraction = bubble
    return gathered, report


def _summary(loop: Loop, spec: RunSpec, throughput: Throughput, peak: PeakFlops | None, gathered: list[RankStats],
             report: TraceReport | None, config: dict[str, Any], fused_stages: list | None = None) -> dict[str, Any]:
    median = loop.times.median_after_warmup()
    return {
        "steps": spec.train.steps,
        "schedule": spec.schedule.name,
        "precision": spec.precision.name,
        "parallel": {"pp": spec.layout.pp, "dp": spec.layout.dp, "tp": spec.layout.tp, "vpp": spec.layout.vpp,
                     "cp": spec.layout.cp, **({"ep": spec.layout.ep} if spec.layout.ep > 1 else {})},
        "batch": {"global": spec.global_batch, "micro": spec.micro_batch, "num_microbatches": spec.microbatches},
        "stages": [list(b) for b in spec.bounds],
        "median_step_time_s": median,
        **throughput.of(median),
        "model_flops_per_iteration": throughput.flops_per_iteration,
        "peak_flops_per_device": vars(peak) if peak else None,
        "bubble_fraction": (sum(report.bubble_fraction_per_rank) / len(report.bubble_fraction_per_rank)
                            if report else None),
        "trace": report.as_dict() if report else None,
        "final_train_loss": loop.last_loss,
        "final_val_loss": loop.val_loss,
        **loop.model_totals,   # e.g. moe_tokens_dropped: token-slots MoE layers dropped for capacity
        **({"models": [{**vars(v), "final_train_loss": m["loss"], "final_val_loss": m.get("val_loss")}
                       for v, m in zip(spec.multi_model.variants, loop.models)],
            "fused_stages": fused_stages} if loop.models is not None else {}),
        "ranks": [vars(s) for s in gathered],
        "config": config,
    }

