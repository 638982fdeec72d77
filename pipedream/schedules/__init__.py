"""Pipeline schedules as data: ``build_schedule(name, pp, microbatches, vpp)`` returns, for every
pipeline rank, the list of actions it executes in one iteration (flush schedules) or, for the
asynchronous schedules (``ASYNC_SCHEDULES``), in a whole run of ``steps`` steps of ``microbatches``
micro-batches each. No torch imports here."""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable

from .actions import Action, Kind, format_actions, parse_action, parse_actions
from .common import ScheduleError, peer_stage, virtual_stage
from .gpipe import gpipe
from .interleaved import interleaved
from .one_f_one_b import one_f_one_b
from .pipedream_async import pipedream, pipedream_replicated
from .replicated import ReplicatedPipeline
from .two_bw import two_bw

ScheduleFn = Callable[..., list[list[Action]]]

SCHEDULES: MappingProxyType[str, ScheduleFn] = MappingProxyType({
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "pipedream": pipedream,
    "2bw": two_bw,
})
ASYNC_SCHEDULES = frozenset({"pipedream", "2bw"})
"""No flush: the action lists span the whole run; weights have several versions."""


def build_schedule(name: str, pp: int, microbatches: int, vpp: int = 1, steps: int = 1) -> list[list[Action]]:
    """Per pipeline rank, the actions of one iteration (``steps`` iterations for the asynchronous
    schedules, which never flush); ScheduleError (one line) for bad sizes."""
    if name not in SCHEDULES:
        raise ScheduleError(f"schedule={name!r} is unknown; choose one of {sorted(SCHEDULES)}")
    if name in ASYNC_SCHEDULES:
        return SCHEDULES[name](pp, microbatches, vpp, steps)
    return SCHEDULES[name](pp, microbatches, vpp)


__all__ = ["ASYNC_SCHEDULES", "Action", "Kind", "ReplicatedPipeline", "SCHEDULES", "ScheduleError",
           "build_schedule", "format_actions", "parse_action", "parse_actions", "peer_stage",
           "pipedream_replicated", "virtual_stage"]
