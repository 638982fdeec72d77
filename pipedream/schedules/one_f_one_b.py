"""1F1B with a flush (PipeDream-Flush, dissertation ch. 3.2.2).

Stage s runs p - s - 1 warm-up forwards, then alternates one forward and one backward, then
drains the remaining backwards; at most p - s micro-batches are in flight at stage s.
"""
from __future__ import annotations

from .actions import Action
from .common import ScheduleError, backward_block, check_sizes, flush_update, forward_block


def one_f_one_b(pp: int, microbatches: int, vpp: int = 1) -> list[list[Action]]:
    check_sizes(pp, microbatches, vpp)
    if vpp != 1:
        raise ScheduleError(f"schedule 1f1b needs vpp = 1, got {vpp}; use schedule=interleaved for vpp > 1")
    ranks = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, microbatches)
        actions: list[Action] = []
        for mb in range(warmup):
            actions += forward_block(mb, 0, rank, pp)
        for i in range(microbatches - warmup):
            actions += forward_block(warmup + i, 0, rank, pp)
            actions += backward_block(i, 0, rank, pp)
        for mb in range(microbatches - warmup, microbatches):
            actions += backward_block(mb, 0, rank, pp)
        ranks.append(actions + flush_update())
    return ranks
