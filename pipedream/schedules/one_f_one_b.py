"""1F1B with a flush (PipeDream-Flush, dissertation ch. 3.2.2).

Stage s runs p - s - 1 warm-up forwards, then alternates one forward and one backward, then
drains the remaining backwards; at most p - s micro-batches are in flight at stage s.
"""
from __future__ import annotations

import numpy as np

from pipedream.schedules.actions import Action
from pipedream.schedules.common import backward_block, check_sizes, flush_update, forward_block, one_f_one_b_order
from pipedream.schedules.info import ScheduleInfo, SizeRule

ONE_CHUNK = SizeRule(lambda p, m, v: v == 1,
                     lambda p, m, v: f"schedule 1f1b needs vpp = 1, got {v}; use schedule=interleaved for vpp > 1")


def one_f_one_b(pp: int, microbatches: int, vpp: int = 1) -> list[list[Action]]:
    check_sizes(pp, microbatches, vpp)
    INFO.check(pp, microbatches, vpp)
    return [one_f_one_b_order(rank, pp, microbatches, lambda mb, r=rank: forward_block(mb, 0, r, pp),
                              lambda mb, r=rank: backward_block(mb, 0, r, pp)) + flush_update()
            for rank in range(pp)]


def in_flight(stage, p, m, v=1):
    """p - stage, at most m: the warm-up forwards and the one in progress."""
    return np.minimum(p - stage, m)


INFO = ScheduleInfo(name="1f1b", build=one_f_one_b, refuses=(ONE_CHUNK,),
                    bubble=lambda p, m, v: (p - 1) / m, bubble_rule="(p-1)/m", in_flight=in_flight)
