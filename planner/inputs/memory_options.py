"""The memory savers a plan may use, as the user allowed them (``planner.*``): read by the searches
and priced by ``planner.costs.uniform``."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryOptions:
    """The memory savers of large-model training beyond full recomputation (docs/planner.md, Memory
    savers): ``selective`` recomputes only the attention cores (their activations dropped, their
    forward FLOPs spent again in the backward); ``sequence_parallel`` shards the LayerNorm/dropout
    regions t ways (same communication volume); ``optimizer_shards`` = d with the distributed
    optimizer (optimizer state and fp32 master weights split over the data-parallel group, the
    update 1/d as long, the reduce-scatter + all-gather as long as the all-reduce, the reduce-scatter
    overlapping the backward like the all-reduce where ``grad_bucket_bytes`` is set);
    ``grad_bucket_bytes`` (not None) overlaps the data-parallel reduction with the last
    micro-batch's backward in buckets of that size; ``recompute_layers`` = k (recompute.num_layers)
    limits full or selective recomputation to the first k layers of each chunk, the rest keeping
    their activations and skipping the extra forward. ``zero`` is the ZeRO level (optim.distributed:
    0 none, 1 optimizer state, 2 also gradients, 3 also parameters, each split ``optimizer_shards``
    ways: the d x c ranks that reduce gradients together)."""

    selective: bool = False
    sequence_parallel: bool = False
    optimizer_shards: int = 1
    grad_bucket_bytes: float | None = None
    recompute_layers: int | None = None
    zero: int = 0

    @property
    def gradient_shards(self) -> int:
        return self.optimizer_shards if self.zero >= 2 else 1

    @property
    def parameter_shards(self) -> int:
        return self.optimizer_shards if self.zero >= 3 else 1
