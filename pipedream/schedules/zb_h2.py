"""ZB-H2 (Qi et al. 2023): 1F1B with the backward split into B and W, more warm-up forwards.

Every stage admits up to 2p - 1 micro-batches (counted until their W), so stage 0's warm-up
forwards cover the whole round trip of the first micro-batch and later stages can run their Bs
back to back in the drain (W waits), and W fills every bubble that is left. With F = B = W, every rank then works without a gap from its first F to its last W (a
parallelogram): a flushed iteration still has the (p - 1)-step fill and drain edges, which only
an optimizer step without the global synchronisation (the paper's post-validation) removes.
Memory: up to 2p - 1 micro-batches of activations at stage 0, about twice 1F1B's p.
"""
from __future__ import annotations

import numpy as np

from pipedream.schedules.actions import Action
from pipedream.schedules.common import add_communication, check_sizes, flush_update
from pipedream.schedules.info import ScheduleInfo, SizeRule
from pipedream.schedules.placement import Placement
from pipedream.schedules.zb_order import zero_bubble_order


def in_flight_limit(rank: int, pp: int) -> int:
    """Micro-batches stage ``rank`` may hold (forwarded, W not yet run): the same at every stage."""
    return 2 * pp - 1


def zb_h2(pp: int, microbatches: int, vpp: int = 1) -> list[list[Action]]:
    check_sizes(pp, microbatches, vpp)
    INFO.check(pp, microbatches, vpp)
    placement = Placement(pp, 1)
    compute = zero_bubble_order(placement, microbatches, [in_flight_limit(r, pp) for r in range(pp)])
    return [actions + flush_update() for actions in add_communication(compute, pp, 1, placement)]


def bubble(p, m, v=1):
    """One forward of fill per stage, (p-1)/(3m); with m < p the first micro-batch's round trip is
    longer than the work, 2m + 2p - 1 steps."""
    p, m = np.asarray(p, dtype=float), np.asarray(m, dtype=float)
    return np.maximum(3.0 * m + p - 1.0, 2.0 * m + 2.0 * p - 1.0) / (3.0 * m) - 1.0


INFO = ScheduleInfo(
    name="zb_h2", build=zb_h2, split_backward=True, bubble=bubble, bubble_rule="(p-1)/(3m) with t_w = t_b/2",
    refuses=(SizeRule(lambda p, m, v: v == 1, lambda p, m, v: f"schedule zb_h2 needs vpp = 1, got {v}; "
                                                              f"use schedule=zbv for two chunks per rank"),),
    in_flight=lambda stage, p, m, v: np.minimum(2 * p - 1, m) + 0 * stage)   # about twice 1F1B's p at stage 0
