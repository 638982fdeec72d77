"""Checks of schedule action lists that only the tests need."""
from __future__ import annotations

from pipedream.schedules import ScheduleError
from pipedream.schedules.actions import COMPUTE_KINDS, Action, Kind


def check_compute(schedule: list[list[Action]], microbatches: int, vpp: int) -> None:
    """Each rank forwards and backwards every (microbatch, chunk) exactly once, backward after forward;
    where a rank lists WEIGHT actions, one per (microbatch, chunk), each after its backward."""
    expected = {(mb, c) for mb in range(microbatches) for c in range(vpp)}
    before = {Kind.BWD: Kind.FWD, Kind.WEIGHT: Kind.BWD}
    names = {Kind.FWD: "forward", Kind.BWD: "backward"}
    for rank, actions in enumerate(schedule):
        seen: dict[Kind, set[tuple[int, int]]] = {Kind.FWD: set(), Kind.BWD: set(), Kind.WEIGHT: set()}
        for action in actions:
            if action.kind not in COMPUTE_KINDS:
                continue
            key = (action.microbatch, action.chunk)
            if key in seen[action.kind]:
                raise ScheduleError(f"rank {rank}: {action} appears twice")
            if action.kind in before and key not in seen[before[action.kind]]:
                raise ScheduleError(f"rank {rank}: {action} comes before its {names[before[action.kind]]}")
            seen[action.kind].add(key)
        if not seen[Kind.WEIGHT]:
            del seen[Kind.WEIGHT]   # backwards run whole
        for kind, keys in seen.items():
            if keys != expected:
                missing = sorted(expected - keys)[:3]
                raise ScheduleError(f"rank {rank}: {kind.name} covers {len(keys)} of {len(expected)} "
                                    f"(microbatch, chunk) pairs; missing e.g. {missing}")


def check_local_handover(schedule: list[list[Action]], placement) -> None:
    """Where a tensor changes chunk on one rank (the bottom of a V), no message orders the two
    computes: the rank's own list must run the earlier virtual stage's F (and the later one's B) first."""
    for rank, actions in enumerate(schedule):
        position = {a: i for i, a in enumerate(actions)}
        for a in actions:
            if a.kind is Kind.FWD and placement.is_local(rank, a.chunk, -1):
                _, chunk = placement.stage_of(placement.virtual_stage(rank, a.chunk) - 1)
                first = Action(Kind.FWD, a.microbatch, chunk)
            elif a.kind is Kind.BWD and placement.is_local(rank, a.chunk, 1):
                _, chunk = placement.stage_of(placement.virtual_stage(rank, a.chunk) + 1)
                first = Action(Kind.BWD, a.microbatch, chunk)
            else:
                continue
            if position.get(first, len(actions)) > position[a]:
                raise ScheduleError(f"rank {rank}: {a} runs before {first}, whose output it takes without a message")
