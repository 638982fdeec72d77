"""GPipe: all forwards, then all backwards, then one update (a pipeline flush every iteration)."""
from __future__ import annotations

from pipedream.schedules.actions import Action
from pipedream.schedules.common import backward_block, check_sizes, flush_update, forward_block
from pipedream.schedules.actions import ScheduleError


def gpipe(pp: int, microbatches: int, vpp: int = 1) -> list[list[Action]]:
    check_sizes(pp, microbatches, vpp)
    if vpp != 1:
        raise ScheduleError(f"schedule gpipe needs vpp = 1, got {vpp}; use schedule=interleaved for vpp > 1")
    ranks = []
    for rank in range(pp):
        actions: list[Action] = []
        for mb in range(microbatches):
            actions += forward_block(mb, 0, rank, pp)
        for mb in range(microbatches):
            actions += backward_block(mb, 0, rank, pp)
        ranks.append(actions + flush_update())
    return ranks
