"""GPipe: all forwards, then all backwards, then one update (a pipeline flush every iteration)."""
from __future__ import annotations

from pipedream.schedules.actions import Action
from pipedream.schedules.common import backward_block, check_sizes, flush_update, forward_block
from pipedream.schedules.info import ScheduleInfo, SizeRule

ONE_CHUNK = SizeRule(lambda p, m, v: v == 1,
                     lambda p, m, v: f"schedule gpipe needs vpp = 1, got {v}; use schedule=interleaved for vpp > 1")


def gpipe(pp: int, microbatches: int, vpp: int = 1) -> list[list[Action]]:
    check_sizes(pp, microbatches, vpp)
    INFO.check(pp, microbatches, vpp)
    ranks = []
    for rank in range(pp):
        actions: list[Action] = []
        for mb in range(microbatches):
            actions += forward_block(mb, 0, rank, pp)
        for mb in range(microbatches):
            actions += backward_block(mb, 0, rank, pp)
        ranks.append(actions + flush_update())
    return ranks


INFO = ScheduleInfo(
    name="gpipe", build=gpipe, refuses=(ONE_CHUNK,),
    bubble=lambda p, m, v: (p - 1) / m, bubble_rule="(p-1)/m",
    in_flight=lambda stage, p, m, v: m + 0 * stage)   # every micro-batch forwarded before the first backward
