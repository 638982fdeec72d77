"""One rank's share of a pipeline: builds its stage, schedule, communication and optimizer from a
RunSpec, and runs training iterations and evaluation.

Flush schedules run one iteration's action list per ``train_step``. The asynchronous schedules
(pipedream, 2bw) run one window of a run-long action list per call (``AsyncRunner``), update the
weights inside the window (after every micro-batch, or every m), and clip each stage's gradient on
its own: stages update at different times, so a global norm across stages would mix micro-batches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from models.spec import LayerModel

from .async_runner import AsyncRunner
from .comm import PipeComm
from .executor import Batch, Executor, IterationResult
from .grad_accumulation import fuse_grad_accumulation
from .groups import ProcessGroups, layer_owner
from .optim import GradientSync, NonFiniteError, TiedCopy, build_optimizer, build_scheduler
from .run_spec import RunSpec
from .schedules import ASYNC_SCHEDULES, Action, build_schedule
from .schedules.forward_only import forward_only
from .shapes import BoundaryShapes
from .stage import Stage
from .tensor_parallel import TensorParallel


@dataclass
class StepResult:
    loss: float
    grad_norm: float     # NaN when the step did not need it (flush schedules without clipping)
    lr: float


class PipelineEngine:
    def __init__(self, spec: RunSpec, model: LayerModel, rank: int, device: torch.device,
                 groups: ProcessGroups, optim_cfg: Any, train_cfg: Any, timeout: timedelta, recorder=None,
                 tp: TensorParallel | None = None, shape_model: LayerModel | None = None):
        """``model`` is this rank's tensor-parallel slice when ``tp`` is given; ``shape_model`` (the
        dense description) then serves shape inference, since boundary tensors are dense."""
        self.spec, self.model, self.rank, self.device = spec, model, rank, device
        self.tp = tp
        layout = spec.layout
        self.coords = layout.coords(rank)
        self.virtual_stages = [layout.virtual_stage(self.coords.pp, c) for c in range(layout.vpp)]
        my_layers = [i for vs in self.virtual_stages for i in range(*spec.bounds[vs])]
        built = model.build(my_layers)
        for module in built.values():
            module.to(device)
        chunks = [nn.Sequential(*(built[i] for i in range(*spec.bounds[vs]))) for vs in self.virtual_stages]
        last = layout.num_virtual_stages - 1
        self.stage = Stage(chunks, [vs == 0 for vs in self.virtual_stages], [vs == last for vs in self.virtual_stages],
                           model.loss_fn, recompute=spec.recompute)
        if train_cfg.get("fuse_grad_accumulation", True):
            for chunk in chunks:
                fuse_grad_accumulation(chunk, self.stage.weight_grads)
        self.params = self.stage.parameters()
        self.is_async = spec.schedule in ASYNC_SCHEDULES
        self.topology = layout.replicated()
        self.schedule_rank = rank if layout.stage_replicas else self.coords.pp
        self.optimizer = build_optimizer(optim_cfg, self.params, float(train_cfg.lr))
        self.scheduler = build_scheduler(self.optimizer, train_cfg, self._updates_per_step())
        self.grad_clip = float(train_cfg.get("grad_clip", 0.0) or 0.0)
        norm_group = groups.pp if layout.pp > 1 and not self.is_async else None
        self.gradients = GradientSync(self.params, groups.dp, layout.stage_replica_count(self.coords.pp),
                                      self._tied_copies(built, groups), norm_group,
                                      tp_group=groups.tp if layout.tp > 1 else None)
        self.actions = [] if self.is_async else \
            build_schedule(spec.schedule, layout.pp, spec.microbatches, layout.vpp)[self.coords.pp]
        self.eval_actions = self._routed(forward_only(layout.pp, spec.microbatches, layout.vpp)[self.coords.pp])
        input_dtype = model.make_batch(1, torch.Generator().manual_seed(0))[0].dtype
        self.shapes = BoundaryShapes(shape_model or model, list(spec.bounds), input_dtype)
        self.input_shapes: dict[int, tuple[int, ...]] = {}   # micro-batch -> its input's shape
        self.run_shape: tuple[int, ...] | None = None         # asynchronous schedules: the one input shape
        self.comm = None
        if layout.pp > 1:
            self.comm = PipeComm(layout, rank, device, timeout, groups.p2p,
                                 input_spec=lambda mb, c: self.shapes.stage_input(self._shape_of(mb), self.virtual_stages[c]),
                                 output_spec=lambda mb, c: self.shapes.stage_output(self._shape_of(mb), self.virtual_stages[c]),
                                 tp=tp, scatter_gather=spec.scatter_gather)
            self.comm.connect()
        self._last_norm = 0.0
        self._norm_wanted = True
        self._nonfinite = ""
        self.last_losses: dict[int, float] = {}   # async: micro-batch -> loss, of the last window (last stage)
        self.executor = Executor(self.stage, self.comm, self.gradients.sync,
                                 self._async_step if self.is_async else self._step, recorder,
                                 sends_before_sync=not self.is_async,
                                 weight_grads_after_send=bool(train_cfg.get("weight_grads_after_send", True)),
                                 weight_grads_delay=int(train_cfg.get("weight_grads_delay", 1)))
        self.world_group = dist.group.WORLD
        self.runner = None
        if self.is_async:
            self.runner = AsyncRunner(spec.schedule, self.topology, self.schedule_rank, spec.microbatches,
                                      int(train_cfg.steps), spec.vertical_sync, self.executor, self.stage, self.params)

    def _updates_per_step(self) -> int:
        """pipedream updates after every micro-batch this rank runs; the others once per step."""
        if self.spec.schedule != "pipedream":
            return 1
        return len(self.topology.microbatches_of(self.schedule_rank, self.spec.microbatches))

    def _routed(self, actions: list[Action]) -> list[Action]:
        """With stage replicas, a rank runs only the micro-batches routed to it."""
        if not self.spec.layout.stage_replicas:
            return actions
        replicas = self.topology.replicas[self.coords.pp]
        replica = self.topology.replica_of(self.rank)
        return [a for a in actions if a.microbatch % replicas == replica]

    @property
    def weight_versions(self) -> int:
        """Peak weight versions this rank has held (1 for the flush schedules)."""
        if self.runner is None:
            return 1
        store = self.runner.store
        return max(self.runner.peak_versions, store.peak if store is not None else 1)

    def _tied_copies(self, built: dict[int, nn.Module], groups: ProcessGroups) -> list[TiedCopy]:
        copies = []
        for group_spec, process_group in zip(self.model.tied, groups.tied):
            if process_group is None:
                continue
            owner_layer = group_spec[0][0]
            mine = [(layer, name) for layer, name in group_spec if layer in built]
            layer, name = mine[0]
            owner = layer_owner(self.spec.layout, list(self.spec.bounds), owner_layer) == self.coords.pp
            copies.append(TiedCopy(built[layer].get_parameter(name), process_group, owner))
        return copies

    def _step(self) -> None:
        # The norm reads every gradient and meets the other stages: a flush schedule computes it
        # only to clip or when asked (a logged step). Without it a non-finite gradient still
        # stops the run, one step later, through the loss.
        self._last_norm = math.nan
        if self.grad_clip > 0 or self._norm_wanted:
            self._last_norm = self.gradients.clip(self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()

    def _async_step(self) -> None:
        """One update of an asynchronous schedule. A non-finite gradient skips the update (weights
        stay finite) and is reported by every rank at the end of the step, where they meet."""
        store = self.executor.weights
        store.before_update()
        try:
            self._last_norm = self.gradients.clip(self.grad_clip)
        except NonFiniteError as error:
            self._nonfinite = self._nonfinite or str(error)
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        store.after_update()

    def train_step(self, batches: dict[int, Batch], grad_norm: bool = True) -> StepResult:
        """One iteration over this rank's micro-batches; returns the global mean loss. For the
        asynchronous schedules: this step's window, with the mean loss of the micro-batches that
        completed in it (NaN when none did, early in a deep pipeline's warm-up). ``grad_norm=False``
        lets a flush schedule skip the gradient norm when it does not clip (every rank must pass
        the same value)."""
        self._norm_wanted = grad_norm
        lr = self.optimizer.param_groups[0]["lr"]
        for model_chunk in self.stage.chunks:
            model_chunk.train()
        if self.runner is not None:
            self._check_run_shape(batches)
            result = self.runner.run_step(self._to_device(batches), self._loss_scale())
            return self._async_result(result, lr)
        self.input_shapes = _input_shapes(batches)
        self.optimizer.zero_grad(set_to_none=True)
        result = self.executor.run(self.actions, self._to_device(batches), loss_scale=1.0 / self.spec.microbatches)
        loss = self._global_mean(result.loss_sum, result.loss_count)
        if not math.isfinite(loss):
            raise NonFiniteError(f"training loss is {loss}: stopped; lower train.lr or check the data")
        return StepResult(loss=loss, grad_norm=self._last_norm, lr=lr)

    def drain(self) -> StepResult | None:
        """Asynchronous schedules: finish every admitted micro-batch (before a checkpoint, or at the
        end; the last step drains by itself). None for flush schedules, which never leave work."""
        if self.runner is None:
            return None
        lr = self.optimizer.param_groups[0]["lr"]
        return self._async_result(self.runner.drain(self._loss_scale()), lr)

    def resume_at(self, step: int) -> None:
        """A run restored from a checkpoint taken after ``drain`` continues at ``step``: the
        asynchronous schedule starts a new segment there (flush schedules need nothing)."""
        if self.runner is not None:
            if self.runner.segment is not None:
                raise RuntimeError("resume_at needs an empty pipeline: call drain() first")
            self.runner.steps_done = step

    def _loss_scale(self) -> float:
        """pipedream: every micro-batch is a mini-batch; 2bw: the batch's m micro-batches are averaged."""
        return 1.0 if self.spec.schedule == "pipedream" else 1.0 / self.spec.microbatches

    def _async_result(self, result: IterationResult, lr: float) -> StepResult:
        self.last_losses = result.losses
        totals = torch.tensor([result.loss_sum, float(result.loss_count), float(bool(self._nonfinite))],
                              dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        loss_sum, count, nonfinite = totals.tolist()
        loss = loss_sum / count if count else math.nan
        if nonfinite or (count and not math.isfinite(loss)):
            detail = self._nonfinite or f"training loss is {loss}"
            raise NonFiniteError(f"{detail} (under schedule={self.spec.schedule}, on some rank): stopped; lower "
                                 f"train.lr or check the data")
        return StepResult(loss=loss, grad_norm=self._last_norm, lr=lr)

    def evaluate(self, batches: dict[int, Batch]) -> float:
        """With an asynchronous run in flight, evaluates the newest weights of every stage (the
        in-flight micro-batches keep their own versions and resume at the next step)."""
        for model_chunk in self.stage.chunks:
            model_chunk.eval()
        parked = self.comm.park() if self.comm is not None and self.is_async else None
        training_shapes, self.input_shapes = self.input_shapes, _input_shapes(batches)
        result = self.executor.run(self.eval_actions, self._to_device(batches), loss_scale=1.0, train=False)
        self.input_shapes = training_shapes
        if parked is not None:
            self.comm.unpark(parked)
        return self._global_mean(result.loss_sum, result.loss_count)

    def _shape_of(self, microbatch: int) -> tuple[int, ...]:
        """Every rank knows each micro-batch's input shape (the data order is deterministic), so
        receivers size their buffers without asking; flush schedules allow a shape per micro-batch."""
        shape = self.input_shapes.get(microbatch, self.run_shape)
        if shape is None:
            raise RuntimeError(f"no input shape is known for micro-batch {microbatch}")
        return shape

    def _check_run_shape(self, batches: dict[int, Batch]) -> None:
        """Asynchronous schedules keep micro-batches of earlier steps in flight, with ids local to a
        segment: they need one input shape for the whole run."""
        for shape in _input_shapes(batches).values():
            if self.run_shape is None:
                self.run_shape = shape
            elif shape != self.run_shape:
                raise ValueError(f"schedule={self.spec.schedule} needs every micro-batch of a run to have the "
                                 f"same shape: got {shape} after {self.run_shape}; pad the data to one shape or "
                                 f"use a flush schedule (1f1b, gpipe, interleaved)")

    def _to_device(self, batches: dict[int, Batch]) -> dict[int, Batch]:
        if self.device.type == "cpu":
            return batches
        return {k: (x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
                for k, (x, y) in batches.items()}

    def _global_mean(self, loss_sum: float, count: int) -> float:
        totals = torch.tensor([loss_sum, float(count)], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        return float(totals[0] / totals[1])


def _input_shapes(batches: dict[int, Batch]) -> dict[int, tuple[int, ...]]:
    return {microbatch: tuple(inputs.shape) for microbatch, (inputs, _) in batches.items()}
