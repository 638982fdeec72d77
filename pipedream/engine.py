"""One rank's share of a pipeline: builds its stage, schedule, communication and optimizer from a
RunSpec, and runs training iterations and evaluation."""
from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from models.spec import LayerModel

from .comm import PipeComm
from .executor import Batch, Executor
from .groups import ProcessGroups, layer_owner
from .optim import GradientSync, NonFiniteError, TiedCopy, build_optimizer, build_scheduler
from .run_spec import RunSpec
from .schedules import build_schedule
from .schedules.forward_only import forward_only
from .shapes import BoundaryShapes
from .stage import Stage


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float


class PipelineEngine:
    def __init__(self, spec: RunSpec, model: LayerModel, rank: int, device: torch.device,
                 groups: ProcessGroups, optim_cfg: Any, train_cfg: Any, timeout: timedelta, recorder=None):
        self.spec, self.model, self.rank, self.device = spec, model, rank, device
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
        self.params = self.stage.parameters()
        self.optimizer = build_optimizer(optim_cfg, self.params, float(train_cfg.lr))
        self.scheduler = build_scheduler(self.optimizer, train_cfg)
        self.grad_clip = float(train_cfg.get("grad_clip", 0.0) or 0.0)
        self.gradients = GradientSync(self.params, groups.dp, layout.dp, self._tied_copies(built, groups),
                                      groups.pp if layout.pp > 1 else None)
        self.actions = build_schedule(spec.schedule, layout.pp, spec.microbatches, layout.vpp)[self.coords.pp]
        self.eval_actions = forward_only(layout.pp, spec.microbatches, layout.vpp)[self.coords.pp]
        input_dtype = model.make_batch(1, torch.Generator().manual_seed(0))[0].dtype
        self.shapes = BoundaryShapes(model, list(spec.bounds), input_dtype)
        self.input_shape: tuple[int, ...] = ()
        self.comm = None
        if layout.pp > 1:
            self.comm = PipeComm(layout, rank, device, timeout,
                                 input_spec=lambda mb, c: self.shapes.stage_input(self.input_shape, self.virtual_stages[c]),
                                 output_spec=lambda mb, c: self.shapes.stage_output(self.input_shape, self.virtual_stages[c]))
        self._last_norm = 0.0
        self.executor = Executor(self.stage, self.comm, self.gradients.sync, self._step, recorder)
        self.world_group = dist.group.WORLD

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
        self._last_norm = self.gradients.clip(self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()

    def train_step(self, batches: dict[int, Batch]) -> StepResult:
        """One iteration over this rank's micro-batches; returns the global mean loss."""
        self._set_input_shape(batches)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.zero_grad(set_to_none=True)
        for model_chunk in self.stage.chunks:
            model_chunk.train()
        result = self.executor.run(self.actions, self._to_device(batches), loss_scale=1.0 / self.spec.microbatches)
        loss = self._global_mean(result.loss_sum, result.loss_count)
        if not math.isfinite(loss):
            raise NonFiniteError(f"training loss is {loss}: stopped; lower train.lr or check the data")
        return StepResult(loss=loss, grad_norm=self._last_norm, lr=lr)

    def evaluate(self, batches: dict[int, Batch]) -> float:
        self._set_input_shape(batches)
        for model_chunk in self.stage.chunks:
            model_chunk.eval()
        result = self.executor.run(self.eval_actions, self._to_device(batches), loss_scale=1.0, train=False)
        return self._global_mean(result.loss_sum, result.loss_count)

    def _set_input_shape(self, batches: dict[int, Batch]) -> None:
        self.input_shape = tuple(next(iter(batches.values()))[0].shape)

    def _to_device(self, batches: dict[int, Batch]) -> dict[int, Batch]:
        if self.device.type == "cpu":
            return batches
        return {k: (x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
                for k, (x, y) in batches.items()}

    def _global_mean(self, loss_sum: float, count: int) -> float:
        totals = torch.tensor([loss_sum, float(count)], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        return float(totals[0] / totals[1])
