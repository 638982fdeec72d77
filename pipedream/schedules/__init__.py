"""Pipeline schedules as data: ``build_schedule(name, pp, microbatches, vpp)`` returns, for every
pipeline rank, the list of actions it executes in one iteration (flush schedules) or, for the
asynchronous schedules (``ScheduleInfo.asynchronous``), in a whole run of ``steps`` steps of
``microbatches`` micro-batches each. No torch imports here.

Every schedule declares a ``ScheduleInfo`` (``info.py``) beside its build function; ``registry.py``
lists them (``SCHEDULE_INFOS``, ``schedule_info(name)``), and the rest of the project reads their
fields instead of comparing names. Split-backward schedules (the zero-bubble orders) list explicit
WEIGHT actions; zbv and dualpipev place their two chunks per rank in a V (``schedule_placement``)."""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable

from pipedream.schedules.actions import Action, Kind, format_actions, parse_action, parse_actions
from pipedream.schedules.common import peer_stage
from pipedream.schedules.actions import ScheduleError
from pipedream.schedules.harmony import HarmonyConfig, harmony_config, harmony_pp
from pipedream.schedules.info import ScheduleInfo, SizeRule
from pipedream.schedules.pipedream_async import pipedream_replicated
from pipedream.schedules.placement import Placement
from pipedream.schedules.registry import SCHEDULE_INFOS, planned_schedules, schedule_info, unknown_schedule
from pipedream.schedules.replicated import ReplicatedPipeline

ScheduleFn = Callable[..., list[list[Action]]]

SCHEDULES: MappingProxyType[str, ScheduleFn] = MappingProxyType(
    {name: info.build for name, info in SCHEDULE_INFOS.items() if info.build is not None})
"""The schedules ``build_schedule`` builds (harmony_pp is built from a ``HarmonyConfig``)."""
ASYNC_SCHEDULES = frozenset(name for name, info in SCHEDULE_INFOS.items() if info.asynchronous)
SPLIT_BACKWARD_SCHEDULES = frozenset(name for name, info in SCHEDULE_INFOS.items() if info.split_backward)
HARMONY_SCHEDULES = frozenset(name for name, info in SCHEDULE_INFOS.items() if info.memory_virtualised)


def schedule_placement(name: str, pp: int, vpp: int = 1) -> Placement:
    """Where the chunks of ``name`` sit: pass its ``peer`` and ``needs`` to the simulator and the
    stream model (round-robin for every schedule but zbv and dualpipev)."""
    return schedule_info(name).placement_for(pp, vpp)


def all_schedules() -> dict[str, ScheduleFn]:
    """Every schedule ``build_schedule`` knows."""
    return dict(SCHEDULES)


def build_schedule(name: str, pp: int, microbatches: int, vpp: int = 1, steps: int = 1) -> list[list[Action]]:
    """Per pipeline rank, the actions of one iteration (``steps`` iterations for the asynchronous
    schedules, which never flush); ScheduleError (one line) for bad sizes."""
    known = all_schedules()
    if name not in known:
        raise ScheduleError(f"schedule={name!r} is unknown; choose one of {sorted(known)}")
    if SCHEDULE_INFOS[name].asynchronous:
        return known[name](pp, microbatches, vpp, steps)
    return known[name](pp, microbatches, vpp)


__all__ = ["ASYNC_SCHEDULES", "Action", "HARMONY_SCHEDULES", "HarmonyConfig", "Kind", "Placement", "ReplicatedPipeline",
           "SCHEDULES", "SCHEDULE_INFOS", "SPLIT_BACKWARD_SCHEDULES", "ScheduleError", "ScheduleInfo", "SizeRule",
           "all_schedules", "build_schedule", "format_actions", "harmony_config", "harmony_pp", "parse_action",
           "parse_actions", "peer_stage", "pipedream_replicated", "planned_schedules", "schedule_info",
           "schedule_placement", "unknown_schedule"]
