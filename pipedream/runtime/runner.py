"""What the engine drives, whatever the schedule: a runner runs one training step, drains,
resumes at a step, owns the optimizer update its executor calls (``executor.step``) and reports
the weight versions it held.

``FlushRunner`` (a schedule whose ``ScheduleInfo.asynchronous`` is false: every step ends in a
flush) is here; ``AsyncRunner`` (``ScheduleInfo.asynchronous``) is in ``async_runner.py``. The
engine picks one from that flag, once (``engine.runner_class``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from models.boundary import to_device
from pipedream.runtime.comm import PipeComm
from pipedream.runtime.executor import Batch, Executor, Recorder
from pipedream.config.layout import ParallelLayout
from pipedream.numerics.loss_scaler import LossScaler
from pipedream.numerics.optim import GradientSync, NonFiniteError
from pipedream.numerics.sharded_optim import ShardedOptimizer
from pipedream.config.run_spec import RunSpec
from pipedream.schedules import build_schedule
from pipedream.schedules.replicated import ReplicatedPipeline
from pipedream.runtime.shapes import InputShapes, input_shapes
from pipedream.config.specs import TrainSpec
from pipedream.runtime.stage import Stage


@dataclass
class StepResult:
    loss: float
    grad_norm: float     # NaN when the step did not need it (flush schedules without clipping)
    lr: float
    models: list[dict[str, float]] | None = None   # a fused model set: each model's loss, grad_norm, lr


@dataclass
class RankParts:
    """One rank's share of the pipeline, built by the engine and shared by its runner."""

    spec: RunSpec
    train: TrainSpec
    stage: Stage
    params: list[nn.Parameter]
    comm: PipeComm | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    gradients: GradientSync
    topology: ReplicatedPipeline
    schedule_rank: int            # this rank in ``topology`` (its pipeline stage without replicas)
    pp_rank: int
    device: torch.device
    shapes: InputShapes = field(default_factory=InputShapes)
    recorder: Recorder | None = None
    scaler: LossScaler | None = None   # precision=fp16 (flush schedules only)

    def make_executor(self, update: Any, sends_before_sync: bool) -> Executor:
        """The runner's executor; ``update`` is called at every STEP action."""
        return Executor(self.stage, self.comm, self.gradients.sync, update, sends_before_sync=sends_before_sync,
                        weight_grads_after_send=self.train.weight_grads_after_send,
                        weight_grads_delay=self.train.weight_grads_delay, recorder=self.recorder,
                        handover=local_handovers(self.spec.layout, self.pp_rank),
                        clock=getattr(self.recorder, "clock", time.perf_counter),
                        pair_forward_backward=self.spec.ep_overlap and self.device.type == "cpu")

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def to_device(self, batches: dict[int, Batch]) -> dict[int, Batch]:
        if self.device.type == "cpu":
            return batches
        return {k: (to_device(x, self.device), to_device(y, self.device)) for k, (x, y) in batches.items()}

    def global_sums(self, *values: float) -> list[float]:
        """Sums over every rank (only the last stage holds losses, so all ranks take part)."""
        totals = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        return totals.tolist()


def local_handovers(layout: ParallelLayout, pp_rank: int) -> dict[int, int]:
    """chunk -> the chunk of the same rank that feeds it (the bottom of a V placement)."""
    handovers = {}
    for chunk in range(layout.vpp):
        if layout.virtual_stage(pp_rank, chunk) > 0:
            source_rank, source_chunk = layout.prev_virtual_stage(pp_rank, chunk)
            if source_rank == pp_rank:
                handovers[chunk] = source_chunk
    return handovers


class Runner(Protocol):
    """Besides these, a runner class states ``global_grad_norm`` (clip by the norm across stages)
    and ``updates_per_step(spec, topology, schedule_rank)`` (for the learning-rate schedule)."""

    executor: Executor
    last_losses: dict[int, float]     # micro-batch -> loss of the last step (last stage; asynchronous only)

    def run_step(self, batches: dict[int, Batch], grad_norm: bool) -> StepResult: ...

    def drain(self) -> StepResult | None: ...

    def resume_at(self, step: int) -> None: ...

    @property
    def weight_versions(self) -> int: ...


class FlushRunner:
    """Each step runs the schedule's whole action list, ending in a flush and one update of every
    stage, so the parameters are the only weight version."""

    global_grad_norm = True   # every stage updates at once: clip by the norm across stages
    weight_versions = 1

    @staticmethod
    def updates_per_step(spec: RunSpec, topology: ReplicatedPipeline, schedule_rank: int) -> int:
        return 1

    def __init__(self, parts: RankParts):
        self.parts = parts
        spec = parts.spec
        self.actions = build_schedule(spec.schedule.name, spec.layout.pp, spec.microbatches, spec.layout.vpp)[parts.pp_rank]
        self.executor = parts.make_executor(self._update, sends_before_sync=True)
        self.last_losses: dict[int, float] = {}
        self._norm = math.nan
        self._norm_wanted = True

    def run_step(self, batches: dict[int, Batch], grad_norm: bool) -> StepResult:
        parts = self.parts
        self._norm_wanted = grad_norm
        lr = parts.lr()
        parts.shapes.current = input_shapes(batches)
        parts.optimizer.zero_grad(set_to_none=True)
        scale = parts.scaler.scale if parts.scaler is not None else 1.0   # fp16: the loss scale
        result = self.executor.run(self.actions, parts.to_device(batches), loss_scale=scale / parts.spec.microbatches)
        loss_sum, count = parts.global_sums(result.loss_sum, float(result.loss_count))
        loss = loss_sum / count
        if not math.isfinite(loss):
            raise NonFiniteError(f"training loss is {loss}: stopped; lower train.lr or check the data")
        return StepResult(loss=loss, grad_norm=self._norm, lr=lr)

    def drain(self) -> None:
        """Nothing to do: a flush leaves no work in flight."""
        return None

    def resume_at(self, step: int) -> None:
        """Nothing to do: the data order and the learning rate follow the restored step."""

    def _update(self) -> None:
        # The norm reads every gradient and meets the other stages: a flush schedule computes it
        # only to clip or when asked (a logged step). Without it a non-finite gradient still
        # stops the run, one step later, through the loss.
        parts = self.parts
        self._norm = math.nan
        # fp16: unscale first (clipping sees true gradients); an overflow on any rank skips the step
        # on every rank (loss_scaler.py), and its norm is not taken
        overflow = parts.scaler is not None and parts.scaler.unscale(_gradient_holder(parts.optimizer))
        if overflow:
            self._norm = math.inf
        elif parts.train.grad_clip > 0 or self._norm_wanted:
            self._norm = parts.gradients.clip(parts.train.grad_clip)
        if parts.scaler is not None:
            parts.scaler.step(parts.optimizer, overflow)
        else:
            parts.optimizer.step()
        parts.scheduler.step()


def _gradient_holder(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose parameters hold the reduced gradients: with ``optim.distributed``, the
    shard's (the loss scaler unscales and checks those)."""
    return optimizer.local if isinstance(optimizer, ShardedOptimizer) else optimizer
