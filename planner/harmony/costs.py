"""harmony_pp's own costs from a calibration sheet (``runtime.harmony`` of a profile entry, written
by ``planner.calibrate.harmony``), by the number of processes they were measured with. Torch-free."""
from __future__ import annotations

from dataclasses import fields
from types import MappingProxyType
from typing import Any, Mapping

from planner.harmony.estimator import HarmonyOverheads
from planner.inputs.cluster_sheet import calibration, model_fingerprint
from planner.inputs.profile import profile_from_json

_KEYS = tuple(f.name for f in fields(HarmonyOverheads))


def harmony_costs(entry: Mapping[str, Any] | None) -> Mapping[int, HarmonyOverheads]:
    """``{processes: HarmonyOverheads}`` of one sheet profile entry (none without a harmony run)."""
    section = ((entry or {}).get("runtime") or {}).get("harmony") or {}
    return MappingProxyType({int(n): HarmonyOverheads(**{k: float(v) for k, v in costs.items() if k in _KEYS})
                             for n, costs in section.items() if n.isdigit()})


def alone_profile(entry: Mapping[str, Any] | None):
    """The model's layers timed alone around the harmony runs (``profile_alone``), as a Profile; None
    for sheets written before it was measured."""
    section = ((entry or {}).get("runtime") or {}).get("harmony") or {}
    return profile_from_json(section["profile_alone"]) if "profile_alone" in section else None


def sheet_entry(cluster, model_cfg: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The cluster's calibration sheet entry for this model (none without one)."""
    data = calibration(cluster)
    return None if data is None else data.get("profiles", {}).get(model_fingerprint(model_cfg))


def measured_harmony(cluster, model_cfg: Mapping[str, Any]) -> Mapping[int, HarmonyOverheads]:
    """The costs for this model from the cluster's calibration sheet (none without one)."""
    return harmony_costs(sheet_entry(cluster, model_cfg))
