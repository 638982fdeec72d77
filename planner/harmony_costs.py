"""harmony_pp's own costs from a calibration sheet (``runtime.harmony`` of a profile entry, written
by ``planner.calibrate_harmony``), by the number of processes they were measured with. Torch-free."""
from __future__ import annotations

from dataclasses import fields
from types import MappingProxyType
from typing import Any, Mapping

from .harmony_estimator import HarmonyOverheads

_KEYS = tuple(f.name for f in fields(HarmonyOverheads))


def harmony_costs(entry: Mapping[str, Any] | None) -> Mapping[int, HarmonyOverheads]:
    """``{processes: HarmonyOverheads}`` of one sheet profile entry (none without a harmony run)."""
    section = ((entry or {}).get("runtime") or {}).get("harmony") or {}
    return MappingProxyType({int(n): HarmonyOverheads(**{k: float(v) for k, v in costs.items() if k in _KEYS})
                             for n, costs in section.items() if n.isdigit()})


def measured_harmony(cluster, model_cfg: Mapping[str, Any]) -> Mapping[int, HarmonyOverheads]:
    """The costs for this model from the cluster's calibration sheet (none without one)."""
    from .cluster_sheet import calibration, model_fingerprint

    data = calibration(cluster)
    return harmony_costs(None if data is None else data.get("profiles", {}).get(model_fingerprint(model_cfg)))
