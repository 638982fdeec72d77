"""What a fused model set changes in one rank's training: an optimizer with each model's own
hyper-parameters stepping the stacked parameters, clipping by each model's own gradient norm,
per-model losses, stacked data."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipedream.config.specs import OptimSpec
from pipedream.multi_model.fused import FusedLayerModel, model_views, stack_values
from pipedream.multi_model.spec import MultiModelSpec
from pipedream.numerics.optim import GradientSync, NonFiniteError, _with_fused_kernel
from pipedream.runtime.runner import FlushRunner, StepResult


class StepsStacks:
    """An optimizer over model k's views of the stacks (``fused.model_views``), two groups per
    model with its own learning rate and weight decay: torch's own update, per model, in place in
    the stacks. Each view's gradient is model k's slice of its stack's gradient (no copy), linked
    again only when the stack has a new gradient tensor: clearing gradients zeroes the stacks'
    in place, which clears the views' too."""

    stacks: list[nn.Parameter]

    def _link_gradients(self) -> None:
        linked = self.__dict__.setdefault("_linked", {})
        for stacked in self.stacks:
            grad = stacked.grad
            if grad is not None and linked.get(id(stacked)) is not grad:
                for k, view in enumerate(model_views(stacked)):
                    view.grad = grad[k]
                linked[id(stacked)] = grad

    def step(self, closure: Any = None) -> Any:
        self._link_gradients()
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for stacked in self.stacks:
            if stacked.grad is not None:
                stacked.grad.zero_()
        for group in self.param_groups:   # views with gradients of their own (not the stacks')
            for view in group["params"]:
                if view.grad is not None and view.grad._base is None:
                    view.grad = None
class StackedAdamW(StepsStacks, torch.optim.AdamW):
    pass


class StackedSGD(StepsStacks, torch.optim.SGD):
    pass


def build_multi_optimizer(optim: OptimSpec, params: list[nn.Parameter], spec: MultiModelSpec
                          ) -> torch.optim.Optimizer:
    """Two groups (matrices decayed, the rest not, as ``optim.parameter_groups``) per distinct
    learning rate and weight decay: models that share both share the two groups, so one call of
    torch's fused kernel (``optim.fused``) steps all their views; the update of every tensor is
    the same either way (it depends only on its group's hyper-parameters). The schedule scales each
    group's own rate; ``optimizer.model_groups[k]`` is model k's decayed group."""
    groups: list[dict[str, Any]] = []
    first_group: dict[tuple[float, float], int] = {}
    model_groups = []
    for variant in spec.variants:
        key = (variant.lr, variant.weight_decay)
        if key not in first_group:
            first_group[key] = len(groups)
            groups.append({"params": [], "weight_decay": variant.weight_decay, "lr": variant.lr})
            groups.append({"params": [], "weight_decay": 0.0, "lr": variant.lr})
        decayed = first_group[key]
        model_groups.append(decayed)
        mine = [model_views(p)[variant.index] for p in params]
        groups[decayed]["params"] += [p for p in mine if p.dim() >= 2]
        groups[decayed + 1]["params"] += [p for p in mine if p.dim() < 2]
    lr = spec.variants[0].lr
    if optim.name == "adamw":
        optimizer = _with_fused_kernel(StackedAdamW, optim.fused, groups, lr=lr,
                                       betas=tuple(float(b) for b in optim.betas), eps=float(optim.eps))
    else:
        optimizer = _with_fused_kernel(StackedSGD, optim.fused, groups, lr=lr, momentum=float(optim.momentum))
    optimizer.stacks = list(params)
    optimizer.model_groups = model_groups
    return optimizer


def _per_model_squares(grad: torch.Tensor) -> torch.Tensor:
    """[K] sums of squares of each model's slice (fp64, reduced in fp32 at least, as ``optim._norm``)."""
    low = grad.dtype in (torch.float16, torch.bfloat16)
    flat = grad.detach().reshape(grad.shape[0], -1)
    return torch.linalg.vector_norm(flat, dim=1, dtype=torch.float32 if low else None).double().pow(2)


class PerModelGradientSync(GradientSync):
    """Clips each model by its own global norm (over its slice of every stack, on every stage),
    as it would be clipped alone."""

    def __init__(self, *args: Any, count: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.count = count
        self.last_norms = [math.nan] * count

    def model_norms(self) -> list[float]:
        owned = [p.grad for p in self.params if p.grad is not None and id(p) not in self._not_owned]
        device = self.params[0].device if self.params else torch.device("cpu")
        squares = torch.stack([_per_model_squares(g) for g in owned]).sum(0) if owned else \
            torch.zeros(self.count, dtype=torch.float64, device=device)
        if self.norm_group is not None:
            dist.all_reduce(squares, group=self.norm_group)
        return [math.sqrt(float(s)) for s in squares]

    def global_norm(self) -> float:
        return math.sqrt(sum(n * n for n in self.model_norms()))

    def clip(self, max_norm: float) -> float:
        norms = self.model_norms()
        self.last_norms = norms
        for k, norm in enumerate(norms):
            if not math.isfinite(norm):
                raise NonFiniteError(f"gradient norm of model {k} is {norm}: training stopped; lower its lr "
                                     f"or enable train.grad_clip, and check the data")
        coefs = [min(1.0, max_norm / (n + 1e-6)) for n in norms]
        if max_norm > 0 and min(coefs) < 1.0:
            for param in self.params:
                if param.grad is not None:
                    scale = torch.tensor(coefs, dtype=param.grad.dtype, device=param.grad.device)
                    param.grad.mul_(scale.view(-1, *([1] * (param.grad.dim() - 1))))
        return math.sqrt(sum(n * n for n in norms))


class MultiModelRunner(FlushRunner):
    """A flush runner that also reports each model's loss, gradient norm and learning rate."""

    def __init__(self, parts: Any, model: FusedLayerModel):
        super().__init__(parts)
        self.model = model
        self.memory = None   # a FeatureMapMemory under a device budget (budget.prepare_fused_stage)

    def run_step(self, batches: dict, grad_norm: bool) -> StepResult:
        losses = self.model.losses
        losses.take(True)
        optimizer = self.parts.optimizer
        lrs = [optimizer.param_groups[group]["lr"] for group in optimizer.model_groups]
        result = super().run_step(batches, grad_norm)
        if self.memory is not None:
            self.memory.end_step()
        sums, calls = losses.take(True)
        per_model = self.parts.global_sums(*sums, float(calls))
        norms = self.parts.gradients.last_norms if not math.isnan(result.grad_norm) else [math.nan] * len(sums)
        result.models = [{"loss": per_model[k] / per_model[-1], "grad_norm": norms[k], "lr": lrs[k]}
                         for k in range(len(sums))]
        return result

    def eval_losses(self) -> list[float]:
        """Collective: each model's mean validation loss since the last call."""
        sums, calls = self.model.losses.take(False)
        totals = self.parts.global_sums(*sums, float(calls))
        return [s / totals[-1] for s in totals[:-1]]


class StackedData:
    """K models' data, each as its own run would read it (``train.seed`` = the model's seed: data
    set, order and shard), stacked along the model dimension micro-batch by micro-batch."""

    def __init__(self, spec: Any, dp_rank: int, sharded_data: type):
        """``spec``: the run's ``RunSpec``, whose ``multi_model`` lists the variants."""
        self.members = [sharded_data(dataclasses.replace(spec, train=dataclasses.replace(spec.train, seed=v.seed)),
                                     dp_rank) for v in spec.multi_model.variants]
        self.val_steps = min(m.val_steps for m in self.members)

    @staticmethod
    def _stacked(parts: list[dict[int, Any]]) -> dict[int, Any]:
        return {mb: (stack_values([p[mb][0] for p in parts]), stack_values([p[mb][1] for p in parts]))
                for mb in parts[0]}

    def train_batches(self, step: int) -> dict[int, Any]:
        return self._stacked([m.train_batches(step) for m in self.members])

    def val_batches(self, index: int) -> dict[int, Any]:
        return self._stacked([m.val_batches(index) for m in self.members])
