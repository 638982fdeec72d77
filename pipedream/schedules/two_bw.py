"""PipeDream-2BW: 1F1B without flushes, gradients accumulated over m >= p micro-batches into one
update per batch, exactly two weight versions per stage (dissertation ch. 3.2.1).

The order of forwards and backwards is 1F1B's over the whole run of ``m * steps`` micro-batches
(warm-up p - s - 1 forwards at stage s, then one forward and one backward, then the drain); the
backward that completes a batch is followed by SYNC_GRADS (data-parallel all-reduce) and STEP.
Micro-batch k (0-indexed) uses weight version max(k // m - 1, 0) in both passes (``versions.py``),
which is always the stage's current or shadow version because m >= p. With ``steps = 1`` the list
is exactly ``1f1b``'s. Steady-state bubble: none; the run's warm-up and drain cost (p-1)(t_f + t_b).
"""
from __future__ import annotations

import numpy as np

from pipedream.schedules.actions import Action, Kind
from pipedream.schedules.common import backward_block, check_sizes, forward_block, one_f_one_b_order
from pipedream.schedules.info import ScheduleInfo, SizeRule
from pipedream.schedules.one_f_one_b import in_flight

REFUSES = (
    SizeRule(lambda p, m, v: v == 1,
             lambda p, m, v: f"schedule 2bw needs vpp = 1, got {v}; interleaving needs a flush schedule"),
    SizeRule(lambda p, m, v: m >= p,
             lambda p, m, v: f"schedule 2bw needs microbatches per batch (m = {m}) >= pp ({p}) so two "
                             f"weight versions suffice: use m >= {p} (raise train.global_batch_size)"),
)


def two_bw(pp: int, microbatches: int, vpp: int = 1, steps: int = 1) -> list[list[Action]]:
    check_sizes(pp, microbatches, vpp)
    check_sizes(pp, steps, vpp)
    INFO.check(pp, microbatches, vpp)
    total = microbatches * steps

    def backward(mb: int, rank: int) -> list[Action]:
        block = backward_block(mb, 0, rank, pp)
        if (mb + 1) % microbatches == 0:
            block += [Action(Kind.SYNC_GRADS), Action(Kind.STEP)]
        return block

    return [one_f_one_b_order(rank, pp, total, lambda mb, r=rank: forward_block(mb, 0, r, pp),
                              lambda mb, r=rank: backward(mb, r)) for rank in range(pp)]


def two_versions(in_flight):
    """The current weights and the shadow version (ch. 3.2.1), whatever is in flight."""
    return 2.0 + 0.0 * np.asarray(in_flight)


INFO = ScheduleInfo(name="2bw", build=two_bw, refuses=REFUSES, asynchronous=True, in_flight=in_flight,
                    weight_versions=two_versions)
