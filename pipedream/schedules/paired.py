"""Forward/backward pairs (DualPipe's overlapped F+B): where a rank's issue order has a forward
whose next compute is a backward of another chunk, the two can run at the same time, so that one's
expert-parallel all-to-all waits while the other computes (``pipedream.runtime.paired_compute``).

Pure data (no torch). A pair is (index of the FWD, index of the BWD) in the issue order, with the
indices of the actions between them that belong to the forward: the sends of its output, which go
out as soon as it is computed. The other actions between them (receive posts, other sends) keep
their place before the backward. Chunks differ, so the two touch disjoint parameters."""
from __future__ import annotations

from dataclasses import dataclass

from pipedream.schedules.actions import COMPUTE_KINDS, Action, Kind


@dataclass(frozen=True)
class Pair:
    forward: int                 # index of the FWD in the issue order
    backward: int                # index of the BWD
    forward_sends: tuple[int, ...]   # indices between them of the forward's output sends


def forward_backward_pairs(order: list[Action]) -> dict[int, Pair]:
    """FWD index -> its ``Pair``, for every FWD whose next compute is a BWD of another chunk."""
    compute = [i for i, a in enumerate(order) if a.kind in COMPUTE_KINDS]
    pairs: dict[int, Pair] = {}
    for i, j in zip(compute, compute[1:]):
        forward, backward = order[i], order[j]
        if forward.kind is not Kind.FWD or backward.kind is not Kind.BWD or forward.chunk == backward.chunk:
            continue
        sends = tuple(k for k in range(i + 1, j) if order[k].kind is Kind.SEND_ACT
                      and (order[k].microbatch, order[k].chunk) == (forward.microbatch, forward.chunk))
        pairs[i] = Pair(i, j, sends)
    return pairs


def pair_partners(order: list[Action]) -> dict[Action, Action]:
    """Each paired FWD -> its BWD and each paired BWD -> its FWD (``forward_backward_pairs``); the
    compute order, and so the pairs, are the same in a schedule's list and in its issue order."""
    partners: dict[Action, Action] = {}
    for pair in forward_backward_pairs(order).values():
        forward, backward = order[pair.forward], order[pair.backward]
        partners[forward], partners[backward] = backward, forward
    return partners
