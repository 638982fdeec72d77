"""Forward passes only (evaluation): chunk by chunk, micro-batch by micro-batch; no stash, no update."""
from __future__ import annotations

from .actions import Action
from .common import check_sizes, forward_block


def forward_only(pp: int, microbatches: int, vpp: int = 1) -> list[list[Action]]:
    check_sizes(pp, microbatches, vpp)
    return [[a for chunk in range(vpp) for mb in range(microbatches) for a in forward_block(mb, chunk, rank, pp, vpp)]
            for rank in range(pp)]
