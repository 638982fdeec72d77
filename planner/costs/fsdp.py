"""ZeRO-3 with ``reshard_after_forward`` (fully sharded, as FSDP): what a rank holds whole and what
its per-layer collectives cost. Each layer is gathered over the d x c ranks before its forward and
again for its backward (again for a recomputed forward), freed after, and its gradients are
reduce-scattered into the rank's fp32 gradient shard after each micro-batch's backward of it.
"""
from __future__ import annotations

import numpy as np

from planner.costs.collectives import allreduce_time
from planner.inputs.hardware import Cluster


def two_largest(values: np.ndarray, owner: np.ndarray, p: int) -> np.ndarray:
    """(p,) the sum of the two largest ``values`` of each rank (``owner``: the rank of each layer)."""
    order = np.lexsort((-values, owner))
    ranked, who = values[order], owner[order]
    start = np.searchsorted(who, np.arange(p))
    position = np.arange(len(ranked)) - start[who]
    return np.bincount(who[position < 2], weights=ranked[position < 2], minlength=p)


def layer_collective_seconds(cluster: Cluster, params: np.ndarray, experts: np.ndarray, group: int, t: int,
                             ep: int) -> np.ndarray:
    """(N,) all-reduce seconds of each layer's parameters over the ``group`` = d c ranks (the routed
    experts' share over the d c / ep ranks holding the same ones); a gather or a reduce-scatter
    is half of it."""
    if group <= 1:
        return np.zeros_like(params)
    dense = allreduce_time(cluster, params - experts, group, t)
    if ep > 1 and experts.any():
        return dense + allreduce_time(cluster, experts, group // ep, t * ep)
    return dense


def exposed_per_microbatch(allreduce: np.ndarray, fwd: np.ndarray, bwd: np.ndarray, first: np.ndarray,
                           last: np.ndarray, again: np.ndarray | None) -> np.ndarray:
    """(nb, N) seconds per micro-batch of each layer's collectives that no compute hides: the
    forward's gather (half the all-reduce) is prefetched under the previous layer's forward, the
    backward's gather and reduce-scatter (a whole all-reduce) under the next layer's backward; a
    recomputed forward (``again``) gathers once more under the previous layer's recomputation.
    The first and last layers of a chunk have no neighbour on the rank: theirs are exposed."""
    before = np.where(first, 0.0, np.roll(fwd, 1, axis=-1))   # the previous layer's forward
    after = np.where(last, 0.0, np.roll(bwd, -1, axis=-1))    # the next layer's backward
    forward = np.maximum(0.0, allreduce / 2 - before)
    backward = np.maximum(0.0, allreduce - after)
    return forward + backward + (forward * again if again is not None else 0.0)
