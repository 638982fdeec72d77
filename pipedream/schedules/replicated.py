"""Who talks to whom in a pipeline whose stages may have different replica counts (1F1B-RR).

Stage s runs on ``replicas[s]`` consecutive ranks (stage 0's first). Micro-batch k visits replica
``k % replicas[s]`` of stage s in both passes (dissertation ch. 2.4.2: deterministic round-robin on
the input id), so the forward and the backward of a micro-batch meet the same weights and stash.
A straight pipeline is the special case of one replica per stage (rank == stage). Pure data: the
simulator, the schedule generators and the runtime's communication all read peers from here.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Hashable

from pipedream.schedules.actions import Action, Kind
from pipedream.schedules.actions import ScheduleError

_DOWNSTREAM = (Kind.SEND_ACT, Kind.RECV_GRAD)
_UPSTREAM = (Kind.RECV_ACT, Kind.SEND_GRAD)


@dataclass(frozen=True)
class ReplicatedPipeline:
    replicas: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ScheduleError("a pipeline needs at least one stage: stage_replicas is empty")
        for stage, count in enumerate(self.replicas):
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise ScheduleError(f"stage {stage} has {count!r} replicas; every stage needs a positive integer")

    @classmethod
    def straight(cls, pp: int) -> "ReplicatedPipeline":
        return cls((1,) * pp)

    @property
    def pp(self) -> int:
        return len(self.replicas)

    @property
    def world_size(self) -> int:
        return self._first_ranks[-1]

    @cached_property
    def _first_ranks(self) -> tuple[int, ...]:
        """first_rank of every stage, then the world size (the simulator asks for them per action)."""
        return tuple(itertools.accumulate(self.replicas, initial=0))

    @cached_property
    def _stage_of_rank(self) -> tuple[int, ...]:
        return tuple(stage for stage, count in enumerate(self.replicas) for _ in range(count))

    def first_rank(self, stage: int) -> int:
        if 0 <= stage <= len(self.replicas):
            return self._first_ranks[stage]
        return sum(self.replicas[:stage])

    def ranks(self, stage: int) -> range:
        start = self.first_rank(stage)
        return range(start, start + self.replicas[stage])

    def stage_of(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a pipeline of {self.world_size} ranks")
        return self._stage_of_rank[rank]

    def replica_of(self, rank: int) -> int:
        return rank - self.first_rank(self.stage_of(rank))

    def route(self, stage: int, microbatch: int) -> int:
        """The rank of ``stage`` that runs ``microbatch``."""
        return self.first_rank(stage) + microbatch % self.replicas[stage]

    def microbatches_of(self, rank: int, total: int) -> range:
        """The micro-batches (of ``total``) that ``rank`` runs, in order."""
        return range(self.replica_of(rank), total, self.replicas[self.stage_of(rank)])

    def in_flight(self, stage: int) -> int:
        """Micro-batches a replica of ``stage`` admits before its first backward: the ranks from this
        stage on, shared by its replicas (NOAM for stage 0, ch. 2.4.2; p - s for a straight pipeline)."""
        return math.ceil(sum(self.replicas[stage:]) / self.replicas[stage])

    def peer(self, rank: int, action: Action, pp: int | None = None, vpp: int | None = None) -> tuple[int, int]:
        """(rank, chunk) at the other end of a comm action; the simulator's ``peer`` signature."""
        stage = self.stage_of(rank)
        if action.kind in _DOWNSTREAM:
            target = stage + 1
        elif action.kind in _UPSTREAM:
            target = stage - 1
        else:
            raise ValueError(f"{action} is not a communication action")
        if not 0 <= target < self.pp:
            raise ScheduleError(f"rank {rank} (stage {stage}): {action} has no peer (stage {target} does not exist)")
        return self.route(target, action.microbatch), 0

    def needs(self, rank: int, action: Action) -> Action | None:
        """The receive a compute action consumes: none for forwards on stage 0 and backwards on the last."""
        stage = self.stage_of(rank)
        if action.kind is Kind.FWD and stage > 0:
            return Action(Kind.RECV_ACT, action.microbatch, 0)
        if action.kind is Kind.BWD and stage < self.pp - 1:
            return Action(Kind.RECV_GRAD, action.microbatch, 0)
        return None

    def sync_group(self, rank: int) -> Hashable:
        """Replicas of one stage all-reduce their gradients together (the simulator's rendezvous)."""
        return self.stage_of(rank)
