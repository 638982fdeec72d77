"""Gradients of the experts a rank holds under expert parallelism (``parallel.ep``).

An expert's gradient on its rank already sums what the tokens of every expert-parallel peer's
micro-batches contributed (the combine's backward brought their gradients back), each peer's loss
being its local mean. Single-process training averages over all dp x cp replicas, as the dense
reduction does; so the experts' gradients are summed over the ranks holding the same experts (the
expert-data-parallel group, dp*cp/ep of them) and divided by dp*cp, not by that group's size.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from pipedream.numerics.grad_buckets import BucketedReduction


def is_expert_parameter(param: nn.Parameter) -> bool:
    """Whether ``param`` belongs to an expert split over the expert-parallel group (``models.families.moe``)."""
    return bool(getattr(param, "expert_parallel", False))


class ExpertGradients:
    """Reduces the expert parameters' gradients (module docstring); their squares for the
    gradient norm are summed over the expert-parallel group, whose ranks hold different experts."""

    def __init__(self, params: list[nn.Parameter], expert_dp_group: dist.ProcessGroup, replicas: int,
                 ep_group: dist.ProcessGroup):
        self.params, self.ep_group = params, ep_group
        # one bucket at the sync: SUM over the expert-dp group, then divided by ``replicas`` (dp x cp)
        self.reduction = BucketedReduction(params, expert_dp_group, replicas, bucket_bytes=1 << 62, overlap=False)

    def sync(self) -> None:
        if self.params:
            self.reduction.finish()   # fills missing gradients with zeros first

    def summed_squares(self, squares: torch.Tensor) -> torch.Tensor:
        """This rank's squares of its experts' gradients (``squares``) summed over the expert-parallel group."""
        dist.all_reduce(squares, group=self.ep_group)
        return squares
