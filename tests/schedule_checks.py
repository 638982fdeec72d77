"""Checks of schedule action lists that only the tests need."""
from __future__ import annotations

from pipedream.schedules import ScheduleError
from pipedream.schedules.actions import COMPUTE_KINDS, Action, Kind


def check_compute(schedule: list[list[Action]], microbatches: int, vpp: int) -> None:
    """Each rank forwards and backwards every (microbatch, chunk) exactly once, backward after forward."""
    expected = {(mb, c) for mb in range(microbatches) for c in range(vpp)}
    for rank, actions in enumerate(schedule):
        seen: dict[Kind, set[tuple[int, int]]] = {Kind.FWD: set(), Kind.BWD: set()}
        for action in actions:
            if action.kind not in COMPUTE_KINDS:
                continue
            key = (action.microbatch, action.chunk)
            if key in seen[action.kind]:
                raise ScheduleError(f"rank {rank}: {action} appears twice")
            if action.kind is Kind.BWD and key not in seen[Kind.FWD]:
                raise ScheduleError(f"rank {rank}: {action} comes before its forward")
            seen[action.kind].add(key)
        for kind, keys in seen.items():
            if keys != expected:
                missing = sorted(expected - keys)[:3]
                raise ScheduleError(f"rank {rank}: {kind.name} covers {len(keys)} of {len(expected)} "
                                    f"(microbatch, chunk) pairs; missing e.g. {missing}")
