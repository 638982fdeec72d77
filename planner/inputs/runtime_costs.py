"""What a training step costs beyond its layers' compute, as ``planner.calibrate.sheet`` measured it from
traces of short real runs (``planner.calibrate.runtime``): the per-action work of the executor, the
per-message work of posting a send or a receive (its transfer inside: no fitted latency is added on
top), the step's fixed part (the flush's gradient synchronisation, the clipping norm, the optimizer
step and zeroing beyond the optimizer fit, the barrier of a step), PipeDream's per-update part, the
pace of the layers inside the runtime's actions relative to the profile, and the resident set of a
training process beyond its model.

Sheet section (inside a profile entry of ``pipedream-cluster-sheet/1``, one per model)::

    "runtime": {"flush" | "2bw" | "pipedream": {
                    "compute_action_s": float,   # per FWD or BWD action, beyond the profiled layers
                    "message_s": float,          # per send or receive posted
                    "step_s": float,             # per step, beyond the optimizer fit
                    "update_s": float,           # pipedream only: per update, beyond the optimizer fit
                    "layer_time_ratio": float},  # traced FWD + BWD time / profiled layers: on the layers
                "process_bytes": float}          # peak RSS of a rank minus its model's bytes

Without a sheet every cost is 0 (the analytic cluster sheets describe GPUs, whose launch overheads
are inside the measured or modelled layer times).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from pipedream.schedules import schedule_info

FAMILIES = ("flush", "2bw", "pipedream")


@dataclass(frozen=True)
class ScheduleOverheads:
    compute_action_s: float = 0.0
    message_s: float = 0.0
    step_s: float = 0.0
    update_s: float = 0.0   # per optimizer update beyond the fit (PipeDream updates after every input)
    layer_time_ratio: float = 1.0   # the layers' time inside the runtime's actions / the profile's (layer_pace)

    def per_microbatch(self, compute_actions, messages):
        """Seconds a rank spends per micro-batch beyond its layers: its actions and its messages."""
        return np.asarray(compute_actions) * self.compute_action_s + np.asarray(messages) * self.message_s


@dataclass(frozen=True)
class RuntimeCosts:
    schedules: Mapping[str, ScheduleOverheads] = field(default_factory=lambda: MappingProxyType({}))
    process_bytes: float = 0.0   # added to every device's memory: the process itself

    def for_schedule(self, schedule: str) -> ScheduleOverheads:
        family = schedule if schedule_info(schedule).asynchronous else "flush"   # each asynchronous one is its own
        return self.schedules.get(family, ScheduleOverheads())

    @property
    def measured(self) -> bool:
        return bool(self.schedules)


NO_RUNTIME_COSTS = RuntimeCosts()


def runtime_costs(entry: Mapping[str, Any] | None, process_base_bytes: float = 0.0) -> RuntimeCosts:
    """The costs of one sheet profile entry (``None`` or an entry without them: none)."""
    runtime = (entry or {}).get("runtime")
    if not runtime:
        return NO_RUNTIME_COSTS
    families = {family: v for family, v in runtime.items() if family in FAMILIES}
    pace = layer_pace([float(v.get("layer_time_ratio", 1.0)) for v in families.values()])
    schedules = {family: ScheduleOverheads(float(v["compute_action_s"]), float(v["message_s"]), float(v["step_s"]),
                                           float(v.get("update_s", 0.0)), pace)
                 for family, v in families.items()}
    return RuntimeCosts(MappingProxyType(schedules), process_base_bytes + float(runtime.get("process_bytes", 0.0)))


def layer_pace(ratios: list[float]) -> float:
    """One pace for the layers of every schedule family: the least of the traced runs' ratios. Their
    layers run at one pace (in one trace, an asynchronous run's FWD and BWD took what a flush run's
    did, within a few percent), and another process can only slow a traced run down, so the least
    disturbed run sets it."""
    return min(ratios) if ratios else 1.0

