"""The compute order of the zero-bubble schedules, found by playing them out at unit costs.

Qi et al. ("Zero Bubble Pipeline Parallelism", 2023) split a backward into B (input gradient,
which the previous stage waits for) and W (weight gradient, which nobody waits for), then place
W where 1F1B leaves bubbles. Their hand-made schedules follow one rule, which this module applies
step by step with F = B = W = 1 time unit per chunk and free communication; at every step each
idle rank runs, in this order of preference:

1. a B whose output gradient has arrived (it unblocks the ranks upstream);
2. an F whose input has arrived, if fewer than ``limit[rank]`` (micro-batch, chunk) pairs are
   in flight there (forwarded, weight gradient not yet run: W still needs the activations);
3. the oldest pending W (it frees memory and fills what would be a bubble).

Per chunk, forwards and backwards go in micro-batch order; W follows the order of the Bs. The
result is only an order: the simulator times it under any costs, and because every rank waits
only for messages that the order itself sends earlier, it cannot deadlock under other costs.
"""
from __future__ import annotations

from collections import deque

from pipedream.schedules.actions import Action, Kind
from pipedream.schedules.actions import ScheduleError
from pipedream.schedules.placement import Placement

_NEVER = float("inf")


def zero_bubble_order(placement: Placement, microbatches: int, limit: list[int]) -> list[list[Action]]:
    """Per rank, its F/B/W order. When several are ready, a B goes to the lowest chunk (its
    micro-batch is closest to done) and an F to the highest (so its backward starts sooner)."""
    pp, vpp, m = placement.pp, placement.vpp, microbatches
    chunks = (tuple(range(vpp)), tuple(range(vpp - 1, -1, -1)))   # B's preference, F's preference
    done: dict[tuple[Kind, int, int], int] = {}      # (kind, mb, virtual stage) -> step it finished
    next_fwd = [[0] * vpp for _ in range(pp)]
    next_bwd = [[0] * vpp for _ in range(pp)]
    pending_w: list[deque[Action]] = [deque() for _ in range(pp)]
    in_flight = [0] * pp
    orders: list[list[Action]] = [[] for _ in range(pp)]
    total = 3 * m * vpp
    step = 0

    def ready(kind: Kind, mb: int, virtual: int, now: int) -> bool:
        if kind is Kind.FWD:
            return virtual == 0 or done.get((Kind.FWD, mb, virtual - 1), _NEVER) <= now
        last = placement.num_virtual_stages - 1
        source = (Kind.FWD, mb, virtual) if virtual == last else (Kind.BWD, mb, virtual + 1)
        return done.get(source, _NEVER) <= now

    while any(len(order) < total for order in orders):
        if step > 4 * total + 4 * pp * vpp:
            raise ScheduleError(f"the zero-bubble order stalls with in-flight limits {limit} "
                                f"(pp = {pp}, vpp = {vpp}, microbatches = {m}): raise the limits")
        finished: list[tuple[Kind, int, int]] = []
        for rank in range(pp):
            action = _pick(rank, step, chunks, placement, m, limit[rank], next_fwd[rank], next_bwd[rank],
                           pending_w[rank], in_flight, ready)
            if action is None:
                continue
            orders[rank].append(action)
            virtual = placement.virtual_stage(rank, action.chunk)
            if action.kind is Kind.FWD:
                next_fwd[rank][action.chunk] += 1
                in_flight[rank] += 1
            elif action.kind is Kind.BWD:
                next_bwd[rank][action.chunk] += 1
                pending_w[rank].append(Action(Kind.WEIGHT, action.microbatch, action.chunk))
            else:
                in_flight[rank] -= 1
            finished.append((action.kind, action.microbatch, virtual))
        step += 1
        for key in finished:   # results are visible from the next step on
            done[key] = step
    return orders


def _pick(rank, now, chunks, placement, m, limit, next_fwd, next_bwd, pending_w, in_flight, ready):
    """The action ``rank`` starts at step ``now`` (see the module's rule), or None."""
    for chunk in chunks[0]:
        mb = next_bwd[chunk]
        if mb < next_fwd[chunk] and ready(Kind.BWD, mb, placement.virtual_stage(rank, chunk), now):
            return Action(Kind.BWD, mb, chunk)
    if in_flight[rank] < limit:
        for chunk in chunks[1]:
            mb = next_fwd[chunk]
            if mb < m and ready(Kind.FWD, mb, placement.virtual_stage(rank, chunk), now):
                return Action(Kind.FWD, mb, chunk)
    if pending_w:
        return pending_w.popleft()
    return None
