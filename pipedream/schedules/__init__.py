"""Pipeline schedules as data: ``build_schedule(name, pp, microbatches, vpp)`` returns, for every
pipeline rank, the list of actions it executes in one iteration. No torch imports here."""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable

from .actions import Action, Kind, format_actions, parse_action, parse_actions
from .common import ScheduleError, peer_stage, virtual_stage
from .gpipe import gpipe
from .interleaved import interleaved
from .one_f_one_b import one_f_one_b

ScheduleFn = Callable[[int, int, int], list[list[Action]]]

SCHEDULES: MappingProxyType[str, ScheduleFn] = MappingProxyType({
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
})


def build_schedule(name: str, pp: int, microbatches: int, vpp: int = 1) -> list[list[Action]]:
    """Per pipeline rank, the actions of one iteration; ScheduleError (one line) for bad sizes."""
    if name not in SCHEDULES:
        raise ScheduleError(f"schedule={name!r} is unknown; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[name](pp, microbatches, vpp)


__all__ = ["Action", "Kind", "SCHEDULES", "ScheduleError", "build_schedule", "format_actions",
           "parse_action", "parse_actions", "peer_stage", "virtual_stage"]
