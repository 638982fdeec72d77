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
    their activations and skipping the extra forward. ``zero`` is the ZeRO level (optim.distributed),
    split ``optimizer_shards`` ways (the d x c ranks that reduce gradients together), as the runtime
    holds it: 1 shards the optimizer state; 2 also the gradients, but only between steps (the
    micro-batches accumulate whole gradients until the step's one reduce-scatter); 3 also the
    parameters between steps, gathered whole from the stage's first forward to its last backward
    of the step, or, with ``reshard_after_forward`` (optim.reshard_after_forward), fully sharded:
    each layer gathered for its forward and its backward and freed after, its gradients
    reduce-scattered into an fp32 shard per micro-batch. So at the peak levels 2 and 3 hold what
    level 1 holds, except that level 3 with ``reshard_after_forward`` holds the shards and about two
    layers whole (``planner.costs.uniform.sharded_peak``)."""

    selective: bool = False
    sequence_parallel: bool = False
    optimizer_shards: int = 1
    grad_bucket_bytes: float | None = None
    recompute_layers: int | None = None
    zero: int = 0
    reshard_after_forward: bool = False   # zero 3 only
