"""Interleaved 1F1B with a flush (PTD-P, dissertation ch. 4.2.2; Megatron-LM's order).

Rank r owns v model chunks; chunk c is virtual stage c*p + r. Each rank walks the same sequence
of m*v "virtual micro-batches" k: micro-batches go in groups of p, and inside a group every chunk
sees the whole group before the next chunk does (forward: chunk 0..v-1, backward: v-1..0)::

    k -> group = k // (p*v), chunk = (k % (p*v)) // p, microbatch = group*p + k % p

Rank r runs ``warmup = min((p - r - 1)*2 + (v - 1)*p, m*v)`` forwards, then alternates one
forward and one backward, then drains the backwards. With v = 1 the warm-up is the plain 1F1B
one (p - r - 1), so the schedule is exactly ``1f1b``. Why the extra p - r - 1 forwards for v > 1:
with free communication p - r - 1 + (v - 1)*p would already reach the ideal bubble (see the
simulator), but Megatron's warm-up leaves slack for message latency, which the simulator shows
(pp=4, vpp=2, m=16, t_b=2, latency 0.5: 112 vs 132 time units per iteration).

Bubble (unit costs, t_f and t_b per chunk): (p - 1)/(v*m) of the ideal compute time.
In-flight (mb, chunk) pairs at rank r peak at ``min(warmup + 1, m*v)``
(= min((p - r - 1)*2 + (v - 1)*p + 1, m*v) for v > 1, min(p - r, m) for v = 1).
"""
from __future__ import annotations

import numpy as np

from pipedream.schedules.actions import Action, Kind
from pipedream.schedules.common import add_communication, check_sizes, flush_update
from pipedream.schedules.info import ScheduleInfo, SizeRule


def _multiple_of_pp(pp: int, microbatches: int, vpp: int) -> str:
    lower = microbatches - microbatches % pp
    options = f"{lower + pp} or {lower}" if lower else f"{pp}"
    return (f"schedule interleaved needs microbatches ({microbatches}) to be a multiple of "
            f"pp ({pp}): use {options} microbatches")


REFUSES = (
    SizeRule(lambda p, m, v: (v <= 1) | (p >= 2),
             lambda p, m, v: f"schedule interleaved with vpp = {v} needs pp >= 2 (one rank has no pipeline "
                             f"to interleave): use vpp = 1 or pp >= 2"),
    SizeRule(lambda p, m, v: (v <= 1) | (m % p == 0), _multiple_of_pp),
)


def in_flight(stage, p, m, v):
    """The warm-up forwards and the one in progress, each 1/v of a stage's activations."""
    return np.where(np.asarray(v) > 1, np.minimum((p - stage - 1) * 2 + (v - 1) * p + 1, m * v),
                    np.minimum(p - stage, m))


def warmup_forwards(rank: int, pp: int, microbatches: int, vpp: int) -> int:
    """Forwards rank ``rank`` runs before its first backward."""
    if vpp == 1:
        return min(pp - rank - 1, microbatches)
    return min((pp - rank - 1) * 2 + (vpp - 1) * pp, microbatches * vpp)


def virtual_microbatch(k: int, pp: int, vpp: int, forward: bool) -> tuple[int, int]:
    """(microbatch, chunk) of the k-th forward (or backward) unit of every rank."""
    in_group = k % (pp * vpp)
    chunk = in_group // pp
    if not forward:
        chunk = vpp - 1 - chunk
    return (k // (pp * vpp)) * pp + in_group % pp, chunk


def interleaved(pp: int, microbatches: int, vpp: int = 1) -> list[list[Action]]:
    check_sizes(pp, microbatches, vpp)
    INFO.check(pp, microbatches, vpp)
    total = microbatches * vpp
    compute = []
    for rank in range(pp):
        warmup = warmup_forwards(rank, pp, microbatches, vpp)

        def fwd(k: int) -> Action:
            return Action(Kind.FWD, *virtual_microbatch(k, pp, vpp, forward=True))

        def bwd(k: int) -> Action:
            return Action(Kind.BWD, *virtual_microbatch(k, pp, vpp, forward=False))

        order = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [fwd(warmup + k), bwd(k)]
        order += [bwd(k) for k in range(total - warmup, total)]
        compute.append(order)
    return [actions + flush_update() for actions in add_communication(compute, pp, vpp)]


INFO = ScheduleInfo(name="interleaved", build=interleaved, refuses=REFUSES, interleaves=True,
                    bubble=lambda p, m, v: (p - 1) / (v * m), bubble_rule="(p-1)/(v m)", in_flight=in_flight)
