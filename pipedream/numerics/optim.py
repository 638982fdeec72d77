"""Optimizer, learning-rate schedule, gradient synchronisation and clipping for one stage."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from pipedream.errors import ConfigError
from pipedream.config.specs import OptimSpec, TrainSpec
from pipedream.numerics.expert_grads import ExpertGradients
from pipedream.numerics.grad_buckets import BucketedReduction, assign_buckets
from pipedream.numerics.sharded_optim import ShardedOptimizer


class NonFiniteError(RuntimeError):
    """The loss or the gradients became inf/NaN: training stops instead of corrupting weights."""


def parameter_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only; biases and norm scales are not decayed."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(optim: OptimSpec, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return optimizer_for_groups(optim, parameter_groups(params, optim.weight_decay), lr)


def build_sharded_optimizer(optim: OptimSpec, params: list[nn.Parameter], lr: float, group: dist.ProcessGroup | None,
                            dp: int, dp_rank: int, bucket_bytes: int | None = None,
                            buckets: list[list[nn.Parameter]] | None = None) -> ShardedOptimizer:
    """``optim.distributed``: the same optimizer over this rank's shard (``sharded_optim``); with
    ``bucket_bytes`` (``train.overlap_grad_reduce``) sharded bucket by bucket, as
    ``grad_buckets.assign_buckets`` cuts ``params`` (in order of use), so each bucket can be
    reduce-scattered during the backward; or cut as ``buckets`` says (zero3's layers)."""
    if buckets is None and bucket_bytes:
        buckets = [b.params for b in assign_buckets(params, bucket_bytes)]
    return ShardedOptimizer(parameter_groups(params, optim.weight_decay), lr,
                            lambda groups: optimizer_for_groups(optim, groups, lr), group, dp, dp_rank, buckets,
                            level=optim.zero)


def optimizer_for_groups(optim: OptimSpec, groups: list[dict[str, Any]], lr: float) -> torch.optim.Optimizer:
    if optim.impl == "apex":   # NVIDIA apex's fused kernels (checked before launch: config.apex_check)
        from pipedream.numerics.apex import apex_optimizer
        options = dict(betas=tuple(float(b) for b in optim.betas), eps=float(optim.eps)) if optim.name == "adamw" \
            else dict(momentum=float(optim.momentum))
        return apex_optimizer(optim.name, groups, lr=lr, **options)
    if optim.name == "adamw":
        return _with_fused_kernel(torch.optim.AdamW, optim.fused, groups, lr=lr,
                                  betas=tuple(float(b) for b in optim.betas), eps=float(optim.eps))
    if optim.name == "sgd":
        return _with_fused_kernel(torch.optim.SGD, optim.fused, groups, lr=lr, momentum=float(optim.momentum))
    raise ConfigError(f"optim={optim.name!r} is unknown: choose adamw or sgd")


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (moments, momentum; its shard with ``optim.distributed``)."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.state_bytes()
    return sum(t.numel() * t.element_size() for s in getattr(optimizer, "state", {}).values() for t in s.values()
               if torch.is_tensor(t))


def _with_fused_kernel(optimizer_class: type[torch.optim.Optimizer], fused: bool, groups: list[dict[str, Any]],
                       **options: Any) -> torch.optim.Optimizer:
    """``optim.fused``: torch's fused kernel, one pass over each tensor (AdamW's step is about 5x
    faster on CPU than the multi-pass foreach one). Where the parameters' device or dtype has no
    fused kernel, torch refuses at construction and the foreach one is used."""
    if fused:
        try:
            return optimizer_class(groups, fused=True, **options)
        except RuntimeError:
            pass
    return optimizer_class(groups, **options)


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Learning-rate multiplier: linear warm-up to 1, then cosine decay to ``min_ratio``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainSpec, updates_per_step: int = 1
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule follows training steps (global batches). A stage that updates several times per
    step (pipedream: after every micro-batch) keeps the rate of the step its update belongs to."""
    warmup, total, min_ratio = int(train.warmup_steps), int(train.steps), float(train.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda u: warmup_cosine(u // updates_per_step, warmup, total, min_ratio))


@dataclass
class TiedCopy:
    """A parameter that is a copy of one shared across stages (e.g. embedding and head)."""

    param: nn.Parameter
    group: dist.ProcessGroup
    owner: bool            # counts towards the gradient norm (exactly one copy does)


def _norm(grad: torch.Tensor) -> torch.Tensor:
    """fp64 L2 norm of one gradient, reduced in fp32 at least (half-precision sums overflow)."""
    low = grad.dtype in (torch.float16, torch.bfloat16)
    return torch.linalg.vector_norm(grad, dtype=torch.float32 if low else None).double()


class GradientSync:
    """All-reduces a stage's gradients: across data-parallel replicas (average, in buckets:
    ``grad_buckets``; ``reduction`` may already have launched some during the backward) and
    across the stages that hold copies of a tied parameter (sum, as in the single-process model).
    With ``sharded`` (``optim.distributed``) the replicas' average is reduce-scattered instead: each
    rank keeps its shard's, and the norm and clipping work on the shards. With ``experts`` (expert
    parallelism) ``params`` are the dense parameters and the experts' reduce on their own groups."""

    def __init__(self, params: list[nn.Parameter], dp_group: dist.ProcessGroup | None, dp: int,
                 tied: list[TiedCopy], norm_group: dist.ProcessGroup | None, tp_group: dist.ProcessGroup | None = None,
                 reduction: BucketedReduction | None = None, sharded: ShardedOptimizer | None = None,
                 experts: ExpertGradients | None = None):
        self.params, self.experts = params, experts
        if reduction is None and dp > 1 and sharded is None:   # one bucket, launched at the sync
            reduction = BucketedReduction(params, dp_group, dp, bucket_bytes=1 << 62, overlap=False)
        self.reduction, self.sharded = reduction, sharded
        self.tp_group = tp_group  # tensor-parallel shards: their squares are summed over this group
        self.dp_group, self.dp = dp_group, dp
        self.tied = tied
        self.norm_group = norm_group
        self._not_owned = {id(t.param) for t in tied if not t.owner}
        self.observe: Callable[[], object] | None = None   # samples the bytes held (held_bytes.HeldBytes)

    def sync(self) -> None:
        if self.observe is not None:   # every gradient whole (and zero3's parameters gathered)
            self.observe()
        if self.sharded is not None:   # tied sums first: the shards then hold the reduced sums
            for copy in self.tied:   # (a missing gradient reduces as zeros; zero2/3 may have dropped landed ones)
                if copy.param.grad is None:
                    copy.param.grad = torch.zeros_like(copy.param)
                dist.all_reduce(copy.param.grad, group=copy.group)
            if self.reduction is not None:   # buckets reduce-scattered during the backward (ShardedReduction)
                self.reduction.finish()
            else:
                self.sharded.reduce_gradients()
            if self.experts is not None:   # whole, beside the shards (numerics/expert_optim.py)
                self.experts.sync()
            return
        for param in self.params:  # parameters that took no part in the loss still sync
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        if self.reduction is not None:
            self.reduction.finish()
        if self.experts is not None:
            self.experts.sync()
        for copy in self.tied:
            dist.all_reduce(copy.param.grad, group=copy.group)

    def global_norm(self) -> float:
        """L2 norm over the whole model's gradients (every stage; tied parameters once)."""
        # Per-tensor norms in the gradients' precision (as clip_grad_norm_), summed in fp64, all on
        # the device: no fp64 copy of every gradient (8x less CPU time) and one host sync, not one
        # per parameter.
        owned = self._owned_grads()
        device = self.params[0].device if self.params else torch.device("cpu")
        squares = _sum_of_squares([g for g, sharded in owned if not sharded], device)
        sharded = _sum_of_squares([g for g, sharded in owned if sharded], device)
        if self.sharded is not None and self.dp > 1:   # shards of the data-parallel group: add them all
            both = torch.stack([squares, sharded])
            dist.all_reduce(both, group=self.dp_group)
            squares, sharded = both[0], both[1]
        if self.tp_group is not None:  # sharded over tensor-parallel ranks: add every shard
            dist.all_reduce(sharded, group=self.tp_group)
        squares = squares + sharded
        if self.experts is not None:
            expert_grads = [p.grad.detach() for p in self.experts.params if p.grad is not None]
            squares = squares + self.experts.summed_squares(_sum_of_squares(expert_grads, device))
        if self.norm_group is not None:
            dist.all_reduce(squares, group=self.norm_group)
        return math.sqrt(float(squares))

    def _owned_grads(self) -> list[tuple[torch.Tensor, bool]]:
        """(gradient, tensor-parallel sharded) of what this rank counts towards the norm."""
        if self.sharded is not None:
            return [(piece.view.grad.detach(), _is_sharded(piece.param)) for piece in self.sharded.pieces
                    if piece.view.grad is not None and id(piece.param) not in self._not_owned]
        return [(p.grad.detach(), _is_sharded(p)) for p in self.params
                if p.grad is not None and id(p) not in self._not_owned]

    def clip(self, max_norm: float) -> float:
        """Scales gradients as torch.nn.utils.clip_grad_norm_ would on the whole model; returns the norm."""
        norm = self.global_norm()
        if not math.isfinite(norm):
            raise NonFiniteError(f"gradient norm is {norm}: training stopped; lower train.lr or enable "
                                 f"train.grad_clip, and check the data")
        if max_norm > 0:
            coef = max_norm / (norm + 1e-6)
            if coef < 1.0:
                for param in self._clipped():
                    if param.grad is not None:
                        param.grad.mul_(coef)
        return norm

    def _clipped(self) -> list[torch.Tensor]:
        experts = self.experts.params if self.experts is not None else []
        if self.sharded is not None:
            return [piece.view for piece in self.sharded.pieces] + experts
        return self.params + experts


def _is_sharded(param: nn.Parameter) -> bool:
    return bool(getattr(param, "tensor_parallel_sharded", False))


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([_norm(g) for g in grads]).pow(2).sum()
