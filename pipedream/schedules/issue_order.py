"""The order in which one rank issues its actions: receives move up by one compute (Harmony's
executor on Gloo: up to the start of their group, ``receives_at_group_start``).

A schedule places each receive just before the compute that consumes it. The executor posts it
earlier, before the compute *before* that one, so the transfer overlaps that compute; sends are
issued right after the compute that produced their tensor; everything else keeps its place.
Every send and receive is non-blocking and waited on only by what needs it (the consuming
compute, or the end of the iteration for sends).

Pure data (no torch): the executor walks this order, and ``stream_model`` checks it under NCCL's
rules (where a send may wait for its receive and calls on one stream run one after the other).
"""
from __future__ import annotations

from pipedream.schedules.actions import COMPUTE_KINDS, Action, Kind

_RECEIVES = frozenset({Kind.RECV_ACT, Kind.RECV_GRAD})


def issue_order(actions: list[Action]) -> list[Action]:
    """``actions`` with the receives between two FWD/BWD moved above the first of them."""
    compute_at = [i for i, a in enumerate(actions) if a.kind in COMPUTE_KINDS]
    hoisted: dict[int, list[Action]] = {}     # compute index -> receives posted just before it
    moved: set[int] = set()
    for current, following in zip(compute_at, compute_at[1:]):
        for i in range(current + 1, following):
            if actions[i].kind in _RECEIVES:
                hoisted.setdefault(current, []).append(actions[i])
                moved.add(i)
    order: list[Action] = []
    for i, action in enumerate(actions):
        if i not in moved:
            order += hoisted.get(i, [])
            order.append(action)
    return order


def receives_at_group_start(actions: list[Action]) -> list[Action]:
    """``actions`` with each receive moved up to just after the latest swap-in of its task's pack
    that ``issue_order`` issues before it (the start of its micro-batch group, or of the group
    before; ``schedules.harmony``): Harmony's order on Gloo. Round the wrap-around a sender is
    often a whole group ahead of its receiver, and on Gloo a message matched only after the sender
    has moved on to wait for a message of its own can sit for milliseconds (both ranks blocked,
    2-6 ms here); posted at the group's start every receive is matched long before its compute. A
    receive with no such swap-in keeps ``issue_order``'s place."""
    others: list[Action] = []                 # everything but the moved receives, in issue order
    group_start: dict[int, int] = {}          # task -> position in ``others`` after its latest pack swap-in
    placed: dict[int, list[Action]] = {}      # position in ``others`` -> receives posted there
    for a in issue_order(actions):
        if a.kind in _RECEIVES and a.chunk in group_start:
            placed.setdefault(group_start[a.chunk], []).append(a)
            continue
        others.append(a)
        if a.kind is Kind.SWAP_IN and a.microbatch < 0:
            group_start[a.chunk] = len(others)
    out: list[Action] = []
    for i, a in enumerate(others):
        out += placed.get(i, [])
        out.append(a)
    return out + placed.get(len(others), [])
