"""ZB-V (Qi et al. 2023): two chunks per rank in a V, the backward split into B and W.

Rank r holds virtual stages r and 2p-1-r (``placement.Placement(p, 2, "vshape")``): a micro-batch
goes down the ranks in chunk 0 and back up in chunk 1, so the first and the last stage are both on
rank 0 and every rank sees its first backward after about the same number of forwards. Each rank
admits up to 2p (micro-batch, chunk) pairs (counted until their W), p micro-batches of a whole
stage's activations: 1F1B's peak (stage 0), on every rank. With F = B = W per chunk a flushed
iteration takes 6m + p - 1 chunk-steps for p <= 4 (at most 2 more up to p = 8 with m >= 2p): only
the fill of p - 1 chunk forwards, half of ZB-H2's.
"""
from __future__ import annotations

from pipedream.schedules.actions import Action
from pipedream.schedules.common import add_communication, check_sizes, flush_update
from pipedream.schedules.actions import ScheduleError
from pipedream.schedules.placement import Placement
from pipedream.schedules.zb_order import zero_bubble_order

CHUNKS = 2


def in_flight_limit(rank: int, pp: int) -> int:
    """(micro-batch, chunk) pairs rank ``rank`` may hold: each chunk is half a stage, so 2p is
    1F1B's stage-0 memory of p micro-batches."""
    return 2 * pp


def zbv(pp: int, microbatches: int, vpp: int = CHUNKS) -> list[list[Action]]:
    check_sizes(pp, microbatches, vpp)
    if vpp not in (1, CHUNKS):  # vpp = 1 means "the default" for callers that always pass one
        raise ScheduleError(f"schedule zbv has exactly {CHUNKS} chunks per rank (a V), got vpp = {vpp}")
    placement = Placement(pp, CHUNKS, "vshape")
    compute = zero_bubble_order(placement, microbatches, [in_flight_limit(r, pp) for r in range(pp)])
    return [actions + flush_update() for actions in add_communication(compute, pp, CHUNKS, placement)]
