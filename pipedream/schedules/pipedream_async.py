"""PipeDream: 1F1B without flushes, one weight update per micro-batch (dissertation ch. 2.4.2).

Every micro-batch is a mini-batch. A replica of stage s admits ``in_flight(s)`` micro-batches
(NOAM = ceil(ranks / replicas of stage 0) at the input stage, p - s on a straight pipeline), then
alternates one forward and one backward; every backward is followed by the stage's update
(SYNC_GRADS all-reduces the gradients of the stage's replicas, STEP applies them). Lists cover a
whole run of ``microbatches * steps`` micro-batches: warm-up, steady state and the final drain.
With replicated stages (1F1B-RR) micro-batch k runs on replica k % r_s of stage s, so the action
lists are per rank of the whole replicated pipeline (``pipedream_replicated``).

Weight versions are not in the actions: which version a forward or backward uses follows from the
list (``versions.py``). Steady-state bubble: none; the warm-up and the drain of the whole run cost
(p - 1)(t_f + t_b) once.
"""
from __future__ import annotations

import math
from functools import reduce

import numpy as np

from pipedream.schedules.actions import Action, Kind
from pipedream.schedules.common import backward_block, check_sizes, forward_block
from pipedream.schedules.info import ScheduleInfo, SizeRule
from pipedream.schedules.actions import ScheduleError
from pipedream.schedules.replicated import ReplicatedPipeline


def per_microbatch_update() -> list[Action]:
    return [Action(Kind.SYNC_GRADS), Action(Kind.STEP)]


def check_replicated_sizes(topology: ReplicatedPipeline, microbatches: int, steps: int) -> None:
    check_sizes(topology.pp, microbatches, 1)
    check_sizes(topology.pp, steps, 1)
    lcm = reduce(math.lcm, topology.replicas, 1)
    if microbatches % lcm:
        lower = microbatches - microbatches % lcm
        options = f"{lower + lcm} or {lower}" if lower else f"{lcm}"
        raise ScheduleError(f"schedule pipedream with stage replicas {list(topology.replicas)} needs the "
                            f"micro-batches per step ({microbatches}) to be a multiple of {lcm} (every stage's "
                            f"replicas update together): use {options}")


def pipedream_replicated(replicas: tuple[int, ...] | list[int], microbatches: int, steps: int = 1
                         ) -> list[list[Action]]:
    """Per rank of the replicated pipeline (stage 0's replicas first), its actions for the whole run."""
    topology = ReplicatedPipeline(tuple(replicas))
    check_replicated_sizes(topology, microbatches, steps)
    total = microbatches * steps
    schedule = []
    for rank in range(topology.world_size):
        stage = topology.stage_of(rank)
        mine = list(topology.microbatches_of(rank, total))
        warmup = min(topology.in_flight(stage) - 1, len(mine))
        actions: list[Action] = []
        for mb in mine[:warmup]:
            actions += forward_block(mb, 0, stage, topology.pp)
        for i in range(len(mine) - warmup):
            actions += forward_block(mine[warmup + i], 0, stage, topology.pp)
            actions += backward_block(mine[i], 0, stage, topology.pp) + per_microbatch_update()
        for mb in mine[len(mine) - warmup:]:
            actions += backward_block(mb, 0, stage, topology.pp) + per_microbatch_update()
        schedule.append(actions)
    return schedule


def pipedream(pp: int, microbatches: int, vpp: int = 1, steps: int = 1) -> list[list[Action]]:
    """Straight pipeline (one replica per stage): rank r is stage r."""
    check_sizes(pp, microbatches, vpp)
    INFO.check(pp, microbatches, vpp)
    return pipedream_replicated((1,) * pp, microbatches, steps)


def stashed_versions(in_flight):
    """Weight stashing: one version per micro-batch in flight (ch. 2.4.3), at least the current one."""
    return np.maximum(np.asarray(in_flight, dtype=float), 1.0)


INFO = ScheduleInfo(
    name="pipedream", build=pipedream, asynchronous=True, updates_per_microbatch=True, replicated_stages=True,
    refuses=(SizeRule(lambda p, m, v: v == 1, lambda p, m, v: f"schedule pipedream needs vpp = 1, got {v}; "
                                                              f"interleaving needs a flush schedule"),),
    in_flight=lambda stage, p, m, v: p - stage + 0 * m,   # NOAM on a straight pipeline, once the run is long enough
    weight_versions=stashed_versions)
