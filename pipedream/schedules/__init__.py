"""Pipeline schedules as data: ``build_schedule(name, pp, microbatches, vpp)`` returns, for every
pipeline rank, the list of actions it executes in one iteration (flush schedules) or, for the
asynchronous schedules (``ASYNC_SCHEDULES``), in a whole run of ``steps`` steps of ``microbatches``
micro-batches each. No torch imports here.

``SPLIT_BACKWARD_SCHEDULES`` (the zero-bubble orders) list explicit WEIGHT actions: their
backwards are split into input and weight gradients. zbv and dualpipev place their two chunks per
rank in a V (``schedule_placement``)."""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable

from pipedream.schedules.actions import Action, Kind, format_actions, parse_action, parse_actions
from pipedream.schedules.common import peer_stage, virtual_stage
from pipedream.schedules.actions import ScheduleError
from pipedream.schedules.dualpipev import dualpipev
from pipedream.schedules.gpipe import gpipe
from pipedream.schedules.harmony import HarmonyConfig, harmony_config, harmony_pp
from pipedream.schedules.interleaved import interleaved
from pipedream.schedules.one_f_one_b import one_f_one_b
from pipedream.schedules.pipedream_async import pipedream, pipedream_replicated
from pipedream.schedules.placement import Placement
from pipedream.schedules.replicated import ReplicatedPipeline
from pipedream.schedules.two_bw import two_bw
from pipedream.schedules.zb_h2 import zb_h2
from pipedream.schedules.zbv import zbv

ScheduleFn = Callable[..., list[list[Action]]]

SCHEDULES: MappingProxyType[str, ScheduleFn] = MappingProxyType({
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "pipedream": pipedream,
    "2bw": two_bw,
    "zb_h2": zb_h2,
    "zbv": zbv,
    "dualpipev": dualpipev,
})
ASYNC_SCHEDULES = frozenset({"pipedream", "2bw"})
"""No flush: the action lists span the whole run; weights have several versions."""
SPLIT_BACKWARD_SCHEDULES = frozenset({"zb_h2", "zbv", "dualpipev"})
"""Their lists hold WEIGHT actions: every BWD is the input gradient only."""
HARMONY_SCHEDULES = frozenset({"harmony_pp"})
"""Memory-virtualised (harmony.py): built from a ``HarmonyConfig`` (layer packs, groups), not by
``build_schedule``; packs wrap round the devices instead of sitting on fixed stages."""
_PLACEMENTS = MappingProxyType({"zbv": ("vshape", 2), "dualpipev": ("vshape", 2)})   # name -> (placement, chunks per rank)


def schedule_placement(name: str, pp: int, vpp: int = 1) -> Placement:
    """Where the chunks of ``name`` sit: pass its ``peer`` and ``needs`` to the simulator and the
    stream model (round-robin for every schedule but zbv and dualpipev)."""
    kind, chunks = _PLACEMENTS.get(name, ("round-robin", vpp))
    return Placement(pp, chunks, kind)


def all_schedules() -> dict[str, ScheduleFn]:
    """Every schedule ``build_schedule`` knows."""
    return dict(SCHEDULES)


def build_schedule(name: str, pp: int, microbatches: int, vpp: int = 1, steps: int = 1) -> list[list[Action]]:
    """Per pipeline rank, the actions of one iteration (``steps`` iterations for the asynchronous
    schedules, which never flush); ScheduleError (one line) for bad sizes."""
    known = all_schedules()
    if name not in known:
        raise ScheduleError(f"schedule={name!r} is unknown; choose one of {sorted(known)}")
    if name in ASYNC_SCHEDULES:
        return known[name](pp, microbatches, vpp, steps)
    return known[name](pp, microbatches, vpp)


__all__ = ["ASYNC_SCHEDULES", "Action", "HARMONY_SCHEDULES", "HarmonyConfig", "Kind", "Placement", "ReplicatedPipeline", "SCHEDULES",
           "SPLIT_BACKWARD_SCHEDULES", "ScheduleError", "all_schedules", "build_schedule", "format_actions",
           "harmony_config", "harmony_pp", "parse_action", "parse_actions", "peer_stage", "pipedream_replicated", "schedule_placement",
           "virtual_stage"]
