"""ZB-V (Qi et al. 2023): two chunks per rank in a V, the backward split into B and W.

Rank r holds virtual stages r and 2p-1-r (``placement.Placement(p, 2, "vshape")``): a micro-batch
goes down the ranks in chunk 0 and back up in chunk 1, so the first and the last stage are both on
rank 0 and every rank sees its first backward after about the same number of forwards. Each rank
admits up to 2p (micro-batch, chunk) pairs (counted until their W), p micro-batches of a whole
stage's activations: 1F1B's peak (stage 0), on every rank. With F = B = W per chunk a flushed
iteration takes 6m + p - 1 chunk-steps for m >= 2p - 1 (the paper's hand-made order, ``v_order``):
only the fill of p - 1 chunk forwards, half of ZB-H2's. Fewer micro-batches take the greedy order of
``zb_order``.
"""
from __future__ import annotations

import numpy as np

from pipedream.schedules.actions import Action, Kind
from pipedream.schedules.common import add_communication, check_sizes, flush_update
from pipedream.schedules.info import ScheduleInfo, SizeRule
from pipedream.schedules.placement import Placement
from pipedream.schedules.zb_order import zero_bubble_order

CHUNKS = 2


def in_flight_limit(rank: int, pp: int) -> int:
    """(micro-batch, chunk) pairs rank ``rank`` may hold: each chunk is half a stage, so 2p is
    1F1B's stage-0 memory of p micro-batches."""
    return 2 * pp


def zbv(pp: int, microbatches: int, vpp: int = CHUNKS) -> list[list[Action]]:
    check_sizes(pp, microbatches, vpp)
    INFO.check(pp, microbatches, vpp)
    placement = Placement(pp, CHUNKS, "vshape")
    if microbatches >= 2 * pp - 1:
        compute = [v_order(rank, pp, microbatches) for rank in range(pp)]
    else:   # too few micro-batches to fill the V's warm-up: the greedy order at unit costs
        compute = zero_bubble_order(placement, microbatches, [in_flight_limit(r, pp) for r in range(pp)])
    return [actions + flush_update() for actions in add_communication(compute, pp, CHUNKS, placement)]


def v_order(rank: int, pp: int, microbatches: int) -> list[Action]:
    """Rank ``rank``'s compute order in Qi et al.'s hand-made ZB-V (m >= 2p - 1), phase by phase.

    At unit costs it is as short as the greedy order (``zb_order``), with the same 2p pairs in
    flight, but a rank runs the input gradient of its first chunk (stage r) one round later: there
    is a whole round of its own work between the moment its last chunk sends a gradient down and
    the moment the gradient it needs comes back up. The greedy order leaves no such slack, so on a
    rank that is slower than the rest, or with message latency, each round waited; measured on 2
    CPU ranks of a small GPT, the greedy order's step was 8% longer than this one's.
    """
    done = {(kind, chunk): 0 for kind in (Kind.FWD, Kind.BWD, Kind.WEIGHT) for chunk in range(CHUNKS)}
    order: list[Action] = []

    def run(*steps: tuple[Kind, int]) -> None:
        for kind, chunk in steps:
            order.append(Action(kind, done[kind, chunk], chunk))
            done[kind, chunk] += 1

    forward, backward, weight = Kind.FWD, Kind.BWD, Kind.WEIGHT
    for _ in range(2 * (pp - rank) - 1):      # fill the way down
        run((forward, 0))
    for _ in range(rank):                     # the first micro-batches come back up
        run((forward, 1), (forward, 0))
    for _ in range(pp - rank):                # the first whole backwards of the last chunk
        run((forward, 1), (backward, 1), (weight, 1))
    while done[forward, 0] < microbatches or done[forward, 1] < done[forward, 0]:   # steady rounds
        if done[forward, 0] < microbatches:
            run((forward, 0))
        run((backward, 0), (weight, 0), (forward, 1), (backward, 1), (weight, 1))
    for _ in range(rank):                     # drain: input gradients first, they unblock the others
        run((backward, 0), (backward, 1))
    for _ in range(pp - rank):
        run((backward, 0), (weight, 0))
    for chunk in (1, 0):                      # the weight gradients left
        while done[weight, chunk] < done[backward, chunk]:
            run((weight, chunk))
    return order


def v_shape_rule(name: str) -> SizeRule:
    """vpp = 1 means "the default" for callers that always pass one."""
    return SizeRule(lambda p, m, v: (v == 1) | (v == CHUNKS),
                    lambda p, m, v: f"schedule {name} has exactly {CHUNKS} chunks per rank (a V), got vpp = {v}")


def bubble(p, m, v=CHUNKS):
    """One chunk forward of fill per rank, (p-1)/(6m), half of ZB-H2's: exact for m >= 2p - 1; below
    that the greedy order may take up to 4p chunk-steps more (``bubble_slack``)."""
    p, m = np.asarray(p, dtype=float), np.asarray(m, dtype=float)
    return np.maximum(6.0 * m + p - 1.0, 2.0 * m + 4.0 * p - 1.0) / (6.0 * m) - 1.0


INFO = ScheduleInfo(
    name="zbv", build=zbv, split_backward=True, placement="vshape", fixed_chunks=CHUNKS, refuses=(v_shape_rule("zbv"),),
    bubble=bubble, bubble_slack=lambda p, m: 0 if m >= 2 * p - 1 else 4 * p, bubble_rule="(p-1)/(6m) with t_w = t_b/2",
    in_flight=lambda stage, p, m, v: np.minimum(2 * p, 2 * m) + 0 * stage)   # p micro-batches: 1F1B's stage 0
