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

from pipedream.schedules.actions import Action, Kind
from pipedream.schedules.common import backward_block, check_sizes, forward_block, one_f_one_b_order
from pipedream.schedules.actions import ScheduleError


def check_two_bw(pp: int, microbatches: int, vpp: int, steps: int = 1) -> None:
    check_sizes(pp, microbatches, vpp)
    check_sizes(pp, steps, vpp)
    if vpp != 1:
        raise ScheduleError(f"schedule 2bw needs vpp = 1, got {vpp}; interleaving needs a flush schedule")
    if microbatches < pp:
        raise ScheduleError(f"schedule 2bw needs microbatches per batch (m = {microbatches}) >= pp ({pp}) so two "
                            f"weight versions suffice: use m >= {pp} (raise train.global_batch_size)")


def two_bw(pp: int, microbatches: int, vpp: int = 1, steps: int = 1) -> list[list[Action]]:
    check_two_bw(pp, microbatches, vpp, steps)
    total = microbatches * steps

    def backward(mb: int, rank: int) -> list[Action]:
        block = backward_block(mb, 0, rank, pp)
        if (mb + 1) % microbatches == 0:
            block += [Action(Kind.SYNC_GRADS), Action(Kind.STEP)]
        return block

    return [one_f_one_b_order(rank, pp, total, lambda mb, r=rank: forward_block(mb, 0, r, pp),
                              lambda mb, r=rank: backward(mb, r)) for rank in range(pp)]
