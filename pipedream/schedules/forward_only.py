"""Forward passes only (evaluation): chunk by chunk, micro-batch by micro-batch; no stash, no update."""
from __future__ import annotations

from pipedream.schedules.actions import Action, Kind
from pipedream.schedules.common import add_communication, check_sizes, forward_block
from pipedream.schedules.placement import Placement


def forward_only(pp: int, microbatches: int, vpp: int = 1, placement: Placement | None = None) -> list[list[Action]]:
    """``placement``: where the chunks sit when not round-robin (zbv's V)."""
    check_sizes(pp, microbatches, vpp)
    if placement is not None and placement.kind != "round-robin":
        compute = [[Action(Kind.FWD, mb, chunk) for chunk in range(vpp) for mb in range(microbatches)]
                   for _ in range(pp)]
        return add_communication(compute, pp, vpp, placement)
    return [[a for chunk in range(vpp) for mb in range(microbatches) for a in forward_block(mb, chunk, rank, pp, vpp)]
            for rank in range(pp)]
