"""Single-process references for the asynchronous schedules, written from the update rules of the
dissertation, not from the runtime: no action lists, no weight store, no communication.

The model is split into the same stages as the run; each stage keeps its history of weight
versions W_s^(0), W_s^(1), ... (version u = after u updates of that stage) and one optimizer.
Micro-batches are processed one at a time in id order k = 0, 1, ...; micro-batch k of step t is
micro-batch k % m of that step's global batch (per data-parallel pipeline for 2BW).

- PipeDream with weight stashing, 1F1B-RR: stage s has r_s replicas, each admitting
  n_s = ceil((r_s + ... + r_{p-1}) / r_s) micro-batches; micro-batch k is the (k // r_s)-th of its
  replica, whose forward comes after that replica's first k // r_s - n_s + 1 updates, so it uses
  v_s(k) = max(0, k // r_s - n_s + 1). Update u of stage s averages the gradients of micro-batches
  u r_s .. u r_s + r_s - 1. Straight pipeline: v_s(k) = max(0, k - p + s + 1), i.e.
  W(t+1) = W(t) - lr * grad f(W_1^(t-p+1), ..., W_p^(t)).
- Vertical sync: every stage uses the input stage's version when k entered, converted to updates of
  stage s: v_s(k) = v_0(k) * r_0 // r_s (all stages at t - p + 1 on a straight pipeline).
- 2BW: batch j (m micro-batches per pipeline, d pipelines) is computed on W^(max(j - 1, 0)) and
  applied to W^(j): W(j+1) = W(j) - lr * grad f(W(j-1)), optimizer state not duplicated.

Gradient clipping acts on each stage's own gradient norm (the runtime's rule for these schedules).
"""
from __future__ import annotations

import copy
import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from models import build_model
from pipedream.data.datasets import build_datasets
from pipedream.data.batching import GlobalBatchOrder, microbatches
from pipedream.numerics.optim import build_optimizer, warmup_cosine
from pipedream.numerics.precision import MixedPrecision
from pipedream.config.run_spec import build_run_spec


@dataclass
class StageHistory:
    module: nn.Module                       # holds the newest weights; the optimizer updates it
    scratch: nn.Module                      # runs a micro-batch with any version
    optimizer: torch.optim.Optimizer
    versions: list[list[torch.Tensor]] = field(default_factory=list)

    def snapshot(self) -> None:
        self.versions.append([p.detach().clone() for p in self.module.parameters()])

    def load(self, version: int) -> nn.Module:
        with torch.no_grad():
            for param, value in zip(self.scratch.parameters(), self.versions[version]):
                param.copy_(value)
        self.scratch.zero_grad(set_to_none=True)
        return self.scratch


@dataclass
class Reference:
    cfg: Any
    stages: list[StageHistory]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    train_set: Any
    losses: dict[tuple[int, int], float] = field(default_factory=dict)   # (pipeline, micro-batch) -> loss
    autocast: Callable[[], Any] = nullcontext   # precision=bf16: the runtime's scheme (pipedream/numerics/precision.py)

    def final_params(self) -> dict[str, torch.Tensor]:
        """Global layer index . parameter name -> tensor (the harness's naming)."""
        spec = build_run_spec(self.cfg)
        out = {}
        for (start, _), stage in zip(spec.bounds, self.stages):
            for name, param in stage.module.named_parameters():
                local, _, rest = name.partition(".")
                out[f"{start + int(local)}.{rest}"] = param.detach().clone()
        return out


def build_reference(cfg: Any) -> Reference:
    spec = build_run_spec(cfg)
    model = build_model(cfg.model, seed=int(cfg.train.seed))
    layers = model.build()
    precision = MixedPrecision(str(cfg.precision.name), "cpu")
    precision.apply(list(layers.values()))
    stages = []
    for start, end in spec.bounds:
        module = nn.Sequential(*(layers[i] for i in range(start, end)))
        optimizer = build_optimizer(spec.optim, list(module.parameters()), spec.train.lr)
        stage = StageHistory(module, copy.deepcopy(module), optimizer)
        stage.snapshot()
        stages.append(stage)
    train_set, _ = build_datasets(cfg.model, cfg.data, int(cfg.train.seed))
    return Reference(cfg, stages, precision.fp32_loss(model.loss_fn), train_set, autocast=precision.autocast)


def step_batches(ref: Reference, step: int, pipelines: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per data-parallel pipeline, the micro-batches of global batch ``step``."""
    cfg = ref.cfg
    order = GlobalBatchOrder(len(ref.train_set), int(cfg.train.global_batch_size), int(cfg.train.seed))
    shard = int(cfg.train.global_batch_size) // pipelines
    indices = order.indices(step)
    return [microbatches(ref.train_set, indices[d * shard:(d + 1) * shard], int(cfg.train.micro_batch_size))
            for d in range(pipelines)]


def run_microbatch(ref: Reference, versions: list[int], batch, scale: float) -> tuple[float, list[list[torch.Tensor]]]:
    """Forward and backward of one micro-batch, stage s on version versions[s]; returns the loss and
    each stage's gradients (of loss * scale)."""
    inputs, target = batch
    modules = [stage.load(v) for stage, v in zip(ref.stages, versions)]
    x = inputs
    with ref.autocast():
        for module in modules:
            x = module(x)
    loss = ref.loss_fn(x, target)
    (loss * scale).backward()
    grads = [[p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in m.parameters()]
             for m in modules]
    return float(loss.detach()), grads


def apply_update(ref: Reference, stage_index: int, grad: list[torch.Tensor], lr_scale: float) -> None:
    stage = ref.stages[stage_index]
    params = list(stage.module.parameters())
    for param, g in zip(params, grad):
        param.grad = g.clone()
    clip = float(ref.cfg.train.get("grad_clip", 0.0) or 0.0)
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(params, clip)
    for group in stage.optimizer.param_groups:
        group["lr"] = float(ref.cfg.train.lr) * lr_scale
    stage.optimizer.step()
    stage.optimizer.zero_grad(set_to_none=True)
    stage.snapshot()


def lr_scale(cfg: Any, step: int) -> float:
    return warmup_cosine(step, int(cfg.train.get("warmup_steps", 0)), int(cfg.train.steps),
                         float(cfg.train.get("min_lr_ratio", 0.1)))


def pipedream_reference(cfg: Any, replicas: list[int], vertical_sync: bool = False,
                        drain_after: int | None = None) -> Reference:
    """PipeDream (1F1B-RR when ``replicas`` differ) with weight stashing or vertical sync. With
    ``drain_after`` the pipeline empties after that many steps and restarts (a new warm-up whose
    versions count from the drained weights)."""
    ref = build_reference(cfg)
    steps = int(cfg.train.steps)
    m = int(cfg.train.global_batch_size) // int(cfg.train.micro_batch_size)
    p = len(replicas)
    admitted = [math.ceil(sum(replicas[s:]) / replicas[s]) for s in range(p)]
    pending: list[list[list[torch.Tensor]]] = [[] for _ in range(p)]
    restart = drain_after * m if drain_after else 0
    for k in range(steps * m):
        step = k // m
        batch = step_batches(ref, step, 1)[0][k % m]
        first = restart if k >= restart else 0      # the micro-batch that began this fill of the pipeline
        base = [first // replicas[s] for s in range(p)]
        ahead = [max(0, (k - first) // replicas[s] - admitted[s] + 1) for s in range(p)]
        stash = [b + a for b, a in zip(base, ahead)]
        versions = [base[s] + ahead[0] * replicas[0] // replicas[s] for s in range(p)] if vertical_sync else stash
        loss, grads = run_microbatch(ref, versions, batch, 1.0)
        ref.losses[(0, k)] = loss
        for s in range(p):
            pending[s].append(grads[s])
            if len(pending[s]) == replicas[s]:
                mean = [sum(gs) / replicas[s] for gs in zip(*pending[s])]
                update = len(ref.stages[s].versions) - 1
                apply_update(ref, s, mean, lr_scale(cfg, update * replicas[s] // m))
                pending[s] = []
    return ref


def two_bw_reference(cfg: Any, pipelines: int) -> Reference:
    """2BW on ``pipelines`` data-parallel pipelines: W(j+1) = W(j) - lr * grad f(W(max(j-1, 0)))."""
    ref = build_reference(cfg)
    steps = int(cfg.train.steps)
    for j in range(steps):
        version = max(j - 1, 0)
        per_pipeline = step_batches(ref, j, pipelines)
        m = len(per_pipeline[0])
        total: list[list[torch.Tensor]] | None = None
        for d, batches in enumerate(per_pipeline):
            for i, batch in enumerate(batches):
                loss, grads = run_microbatch(ref, [version] * len(ref.stages), batch, 1.0 / m)
                ref.losses[(d, j * m + i)] = loss
                total = grads if total is None else [[a + b for a, b in zip(x, y)] for x, y in zip(total, grads)]
        for s, grad in enumerate(total):
            apply_update(ref, s, [g / pipelines for g in grad], lr_scale(cfg, j))
    return ref
