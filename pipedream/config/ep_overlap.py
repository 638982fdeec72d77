"""parallel.ep_overlap: whether a schedule's forward/backward pairs run at the same time so that
expert parallelism's all-to-all hides behind the other half's compute (``runtime.paired_compute``)."""
from __future__ import annotations

from typing import Any

from pipedream.config.layout import ParallelLayout
from pipedream.config.specs import config_value
from pipedream.errors import ConfigError
from pipedream.schedules import SCHEDULE_INFOS, ScheduleInfo


def ep_overlap_enabled(cfg: Any, layout: ParallelLayout, info: ScheduleInfo) -> bool:
    """parallel.ep_overlap (auto where an older config has no such key): whether forward/backward
    pairs hide expert parallelism's all-to-all (``ScheduleInfo.overlaps_all_to_all``). auto: where
    the schedule pairs and ep > 1; true: the same, refused where the schedule cannot pair."""
    value = config_value(cfg, "parallel.ep_overlap")
    value = "auto" if value is None else value
    if value not in ("auto", True, False):
        raise ConfigError(f"parallel.ep_overlap={value!r} must be auto, true or false")
    if value is True and not info.overlaps_all_to_all:
        pairing = ", ".join(n for n, i in SCHEDULE_INFOS.items() if i.overlaps_all_to_all)
        raise ConfigError(f"parallel.ep_overlap=true needs a schedule that pairs a forward with another chunk's "
                          f"backward ({pairing}; got schedule={info.name}): set parallel.ep_overlap=auto or false")
    return value is not False and info.overlaps_all_to_all and layout.ep > 1
