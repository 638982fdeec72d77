"""Every schedule's ``ScheduleInfo``, by name. Adding a schedule: a module with its build function
and ``INFO`` beside it, a YAML file in ``conf/schedule/``, and its ``INFO`` in ``_INFOS`` below."""
from __future__ import annotations

from types import MappingProxyType

from pipedream.schedules.actions import ScheduleError
from pipedream.schedules.dualpipev import INFO as DUALPIPEV
from pipedream.schedules.gpipe import INFO as GPIPE
from pipedream.schedules.harmony import INFO as HARMONY_PP
from pipedream.schedules.harmony import INFO_DP as HARMONY_DP
from pipedream.schedules.info import ScheduleInfo
from pipedream.schedules.interleaved import INFO as INTERLEAVED
from pipedream.schedules.one_f_one_b import INFO as ONE_F_ONE_B
from pipedream.schedules.pipedream_async import INFO as PIPEDREAM
from pipedream.schedules.two_bw import INFO as TWO_BW
from pipedream.schedules.zb_h2 import INFO as ZB_H2
from pipedream.schedules.zbv import INFO as ZBV

_INFOS = (GPIPE, ONE_F_ONE_B, INTERLEAVED, PIPEDREAM, TWO_BW, ZB_H2, ZBV, DUALPIPEV, HARMONY_PP, HARMONY_DP)

SCHEDULE_INFOS: MappingProxyType[str, ScheduleInfo] = MappingProxyType({info.name: info for info in _INFOS})


def unknown_schedule(name: object) -> str:
    """The one line for a name no schedule has: the schedules built by ``build_schedule`` first, then
    the memory-virtualised ones."""
    built = sorted(n for n, info in SCHEDULE_INFOS.items() if info.build is not None)
    others = sorted(n for n, info in SCHEDULE_INFOS.items() if info.build is None)
    return f"schedule={name!r} is unknown: choose one of {', '.join(built + others)}"


def schedule_info(name: str) -> ScheduleInfo:
    """The descriptor of ``name``; ScheduleError (one line) for an unknown name."""
    if name not in SCHEDULE_INFOS:
        raise ScheduleError(unknown_schedule(name))
    return SCHEDULE_INFOS[name]


def planned_schedules() -> tuple[str, ...]:
    """The schedules ``planner.schedules`` may list, in registry order."""
    return tuple(name for name, info in SCHEDULE_INFOS.items() if info.not_planned is None)
