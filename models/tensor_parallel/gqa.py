"""Key/value projections of grouped-query attention when there are fewer key/value heads than
tensor-parallel ranks: every rank keeps the whole (small) projection, replicated, and computes
only the one head its query heads read.

Ranks sharing a head each see only their own query heads' part of its gradient, so both the
input and the weight enter through f (identity forward, all-reduce of the gradient backward):
after the backward every rank holds the dense weight's gradient, as for any replicated
parameter, and the input gradient sums every rank's share like a column-parallel layer's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.errors import ConfigError
from models.tensor_parallel.context import TensorParallel
from models.tensor_parallel.mappings import copy_to_region
from models.tensor_parallel.params import mark_replicated


class ReplicatedHeadLinear(nn.Module):
    """The rows of one head of a dense ``nn.Linear`` (no bias): head ``rank // (t / heads)``."""

    def __init__(self, weight: torch.Tensor, num_heads: int, tp: TensorParallel):
        super().__init__()
        if tp.size % num_heads:
            raise ConfigError(f"model.num_kv_heads={num_heads} does not divide parallel.tp={tp.size}: "
                              f"choose parallel.tp dividing the key/value heads or a multiple of them")
        self.tp = tp
        self.weight = nn.Parameter(weight.detach().clone())
        head_size = weight.shape[0] // num_heads
        head = tp.rank // (tp.size // num_heads)
        self.rows = slice(head * head_size, (head + 1) * head_size)
        mark_replicated(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_region(x, self.tp), copy_to_region(self.weight, self.tp)[self.rows])
