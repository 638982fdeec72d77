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

import numpy as np

from pipedream.schedules.actions import Action
from pipedream.schedules.common import add_communication, check_sizes, flush_update
from pipedream.schedules.info import ScheduleInfo, SizeRule
from pipedream.schedules.placement import Placement
from pipedream.schedules.zb_order import zero_bubble_order

CHUNKS = 2


def in_flight_limit(rank: int, pp: int) -> int:
    """(micro-batch, chunk) pairs rank ``rank`` may hold: each chunk is half a stage, so 2p is
    1F1B's stage-0 memory of p micro-batches."""
    return 2 * pp


def zbv(pp: int, microbatches: int, vpp: int = CHUNKS) -> list[list[Action]]:
    check_sizes(pp, microbatches, vpp)
    INFO.check(pp, microbatches, vpp)
    placement = Placement(pp, CHUNKS, "vshape")
    compute = zero_bubble_order(placement, microbatches, [in_flight_limit(r, pp) for r in range(pp)])
    return [actions + flush_update() for actions in add_communication(compute, pp, CHUNKS, placement)]


def v_shape_rule(name: str) -> SizeRule:
    """vpp = 1 means "the default" for callers that always pass one."""
    return SizeRule(lambda p, m, v: (v == 1) | (v == CHUNKS),
                    lambda p, m, v: f"schedule {name} has exactly {CHUNKS} chunks per rank (a V), got vpp = {v}")


def bubble(p, m, v=CHUNKS):
    """One chunk forward of fill per rank, (p-1)/(6m), half of ZB-H2's: a lower bound, the greedy order
    takes up to 2 chunk-steps more for p >= 5 and m >= 2p, up to 4p below (``bubble_slack``)."""
    p, m = np.asarray(p, dtype=float), np.asarray(m, dtype=float)
    return np.maximum(6.0 * m + p - 1.0, 2.0 * m + 4.0 * p - 1.0) / (6.0 * m) - 1.0


INFO = ScheduleInfo(
    name="zbv", build=zbv, split_backward=True, placement="vshape", fixed_chunks=CHUNKS, refuses=(v_shape_rule("zbv"),),
    bubble=bubble, bubble_slack=lambda p, m: 2 if m >= 2 * p else 4 * p, bubble_rule="(p-1)/(6m) with t_w = t_b/2",
    in_flight=lambda stage, p, m, v: np.minimum(2 * p, 2 * m) + 0 * stage)   # p micro-batches: 1F1B's stage 0
