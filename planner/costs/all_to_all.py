"""Expert parallelism's all-to-alls in the planner: what they cost per micro-batch on the link
their group spans, and the part no compute hides under the schedule."""
from __future__ import annotations

import numpy as np

from pipedream.schedules import schedule_info
from planner.inputs.hardware import Cluster


def alltoall_seconds(col: dict[str, np.ndarray], cluster: Cluster, t: int, c: int, ep: int, share: np.ndarray,
                     again: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(nb, N) seconds of the MoE blocks' all-to-alls per micro-batch, forward and backward: a
    dispatch and a combine each way (a recomputed forward, ``again``, runs its two again), each
    sending (ep - 1)/ep of the tokens' top_k copies off the rank. The exchange crosses the link of
    the span its group covers (``ep_span``)."""
    level = cluster.level_for_span(ep_span(t, ep))
    moved = np.outer(share, col["alltoall_bytes"]) * (ep - 1) / ep
    one = np.where(col["alltoall_bytes"] > 0, moved / level.bandwidth + level.latency, 0.0) if ep > 1 \
        else np.zeros_like(moved)
    forward = 2 * one
    return forward + (forward * again if again is not None else 0.0), 2 * one


def ep_span(t: int, ep: int) -> int:
    """Consecutive ranks an expert-parallel group covers, whatever c and d are. The runtime orders
    ranks tp fastest, then cp, dp, pp (``ParallelLayout.rank_of``) and takes each group from ep
    consecutive (dp, cp) replicas of a stage (``ParallelLayout.expert_groups``): ranks k t ep + i t
    + j for a tp rank j, i < ep, a block of t ep ranks aligned to its size. So the group stays
    inside a node whenever t ep devices fit in one (with ep <= c it lies within one dp rank's cp
    ranks, with ep > c it takes ep / c whole dp ranks: the same span either way)."""
    return t * ep


def alltoall_exposed(stats, schedule: str, compute_scale: float | np.ndarray = 1.0) -> np.ndarray:
    """(nb, p) all-to-all seconds per micro-batch that no compute hides (``stats``: a ``RankStats``). A schedule whose runtime pairs
    a forward with another micro-batch's backward (``ScheduleInfo.overlaps_all_to_all``, the
    runtime's ``paired_compute``) hides the forward's all-to-alls behind up to the backward's
    compute and the backward's behind the forward's; other schedules wait for all of them."""
    if stats.alltoall is None:
        return np.zeros_like(stats.forward)
    forward, backward = stats.alltoall
    if not schedule_info(schedule).overlaps_all_to_all:
        return forward + backward
    return (np.maximum(0.0, forward - stats.backward * compute_scale)
            + np.maximum(0.0, backward - stats.forward * compute_scale))
