"""A measured cluster sheet (``python -m planner.calibrate``) turned into what the planner plans with.

JSON schema ``pipedream-cluster-sheet/1`` (seconds, bytes, bytes/s)::

    {"schema": "pipedream-cluster-sheet/1", "measured_at": str, "host": str, "threads": int,
     "processes": int,                       # processes per node the network was measured with
     "cores": int,                           # the machine's CPU cores (os.cpu_count)
     "device": {"flops_fp32": float,         # one thread's fp32 matmul FLOP/s, every process busy
                "memory_bytes": float,       # RAM of the machine
                "memory_bandwidth": float,   # one process copying a large tensor (read + write)
                "swap_bandwidth": float},    # bytes/s one tensor copied into another (Harmony's swaps here)
     "p2p": {"latency_s": float, "bandwidth": float, "points": [[bytes, seconds], ...],
             "method": str, "note": str},   # how the line was fitted (planner.calibrate.fit)
     "allreduce": {"latency_s": float,      # per ring step (2 (n-1) steps)
                   "bandwidth": float,      # ring bandwidth: 2 (n-1)/n of the bytes move at it
                   "group": int, "points": [[bytes, seconds], ...], "method": str, "note": str},
     "optimizer": {"name": "adamw", "seconds_per_parameter_byte": float, "step_overhead_s": float},
     "compute_slowdown": float,              # factor on the profile's times (1: profiled with every process busy)
     "matmul_slowdown_all_busy": float,      # for the record: a matmul with every process busy / alone
     "process_base_bytes": float,            # resident set of a training process before its model
     "machine_load": {"other_cpu_share": float, "load_average": [1, 5, 15 min]},
     "profiles": {fingerprint: {"model": str, "profile": <pipedream-profile/1>,
                                "profiles_tp": {"2": <pipedream-profile/1 measured at t = 2>},
                                "runtime": <planner.inputs.runtime_costs, with "harmony":
                                            planner.calibrate.harmony's costs by process count>}}}

``conf/cluster/measured.yaml`` names it (``cluster.calibration``, a path). The planner then uses:
the per-layer profile measured for the model being planned (if the sheet has one for exactly this
model configuration; its times scaled by ``compute_slowdown``), p2p latency and bandwidth as the
single topology level, the all-reduce fit for data-parallel gradient sync, the optimizer step
per parameter byte (once per iteration; per micro-batch with PipeDream's weight stashing), the
tensor-parallel layers as measured at t > 1 (their all-reduces inside the layer times), and the
runtime's own costs per action, message and step and its process's resident set.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from pipedream.devices import DeviceSheet

from planner.errors import PlannerError
from planner.inputs.hardware import Cluster, Level
from planner.inputs.profile import Profile, profile_from_json
from planner.inputs.runtime_costs import NO_RUNTIME_COSTS, RuntimeCosts, runtime_costs

SCHEMA = "pipedream-cluster-sheet/1"


def model_fingerprint(model_cfg: Mapping[str, Any]) -> str:
    """The model configuration that a measured profile belongs to (its label ``preset`` left out)."""
    import hashlib   # here: only a measured sheet's lookups hash a model

    keys = {k: v for k, v in model_cfg.items() if k != "preset"}
    return hashlib.sha1(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()[:12]


def load_sheet(path: str | Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PlannerError(f"cluster.calibration={path} does not exist: measure this machine first with "
                           f"python -m planner.calibrate model=<model> planner.calibration_out={path}") from None
    except json.JSONDecodeError as err:
        raise PlannerError(f"cluster.calibration={path} is not JSON ({err}): rerun python -m planner.calibrate") from None
    if data.get("schema") != SCHEMA:
        raise PlannerError(f"cluster.calibration={path} has schema {data.get('schema')!r}, expected {SCHEMA!r}: "
                           f"rerun python -m planner.calibrate")
    for name, value in _fitted_rates(data):   # a sheet written before the fits were bounded
        if not (math.isfinite(value) and value > 0):
            raise PlannerError(f"cluster.calibration={path}: {name} is {value}, not a positive finite rate "
                               f"(the fit of an older calibration): rerun python -m planner.calibrate")
    return data


def _fitted_rates(data: Mapping[str, Any]) -> list[tuple[str, float]]:
    return [(f"{part}.bandwidth", float(data[part]["bandwidth"])) for part in ("p2p", "allreduce")
            if isinstance(data.get(part), Mapping) and "bandwidth" in data[part]]


def measured_cluster(cfg: Mapping[str, Any]) -> Cluster:
    """The Cluster of a ``sheet: measured`` preset: one node of ``devices_per_node`` processes."""
    path = cfg.get("calibration")
    if not path:
        raise PlannerError("cluster.sheet=measured needs cluster.calibration=<sheet.json> "
                           "(written by python -m planner.calibrate)")
    data = load_sheet(str(path))
    per_node = int(cfg.get("devices_per_node", 1))
    if int(cfg.get("nodes", 1)) != 1:
        raise PlannerError(f"cluster.nodes={cfg.get('nodes')}: a measured sheet describes one machine; "
                           f"use cluster.nodes=1")
    dev = data["device"]
    sheet = DeviceSheet("measured", float(dev["memory_bytes"]) / per_node,
                        MappingProxyType({"fp32": float(dev["flops_fp32"])}), float(dev["memory_bandwidth"]),
                        "fp32", 1.0, 1.0)
    p2p = data["p2p"]
    level = Level("measured_p2p", per_node, float(p2p["bandwidth"]), float(p2p["latency_s"]))
    extra = MappingProxyType({"calibration": str(path), "sheet": data})
    return Cluster(str(cfg.get("name", "measured")), sheet, (level,), per_node, str(cfg.get("device", "cpu")), extra)


def calibration(cluster: Cluster) -> Mapping[str, Any] | None:
    return cluster.extra.get("sheet") if cluster.extra else None


def _entry(cluster: Cluster, model_cfg: Mapping[str, Any]) -> Mapping[str, Any] | None:
    data = calibration(cluster)
    return None if data is None else data.get("profiles", {}).get(model_fingerprint(model_cfg))


def measured_profile(cluster: Cluster, model_cfg: Mapping[str, Any]) -> Profile | None:
    """This model's profile from the sheet, its times scaled to every process computing at once."""
    entry = _entry(cluster, model_cfg)
    return None if entry is None else _scaled(cluster, entry["profile"])


def measured_tp_profiles(cluster: Cluster, model_cfg: Mapping[str, Any]) -> dict[int, Profile]:
    """This model's tensor-parallel profiles from the sheet, by degree (none without a sheet)."""
    entry = _entry(cluster, model_cfg) or {}
    return {int(t): _scaled(cluster, prof) for t, prof in entry.get("profiles_tp", {}).items()}


def measured_runtime(cluster: Cluster, model_cfg: Mapping[str, Any]) -> RuntimeCosts:
    """The runtime's own costs for this model (none without a sheet or without a traced run)."""
    data = calibration(cluster)
    if data is None:
        return NO_RUNTIME_COSTS
    return runtime_costs(_entry(cluster, model_cfg), float(data.get("process_base_bytes", 0.0)))


def _scaled(cluster: Cluster, profile_json: Mapping[str, Any]) -> Profile:
    data = calibration(cluster) or {}
    profile = profile_from_json(profile_json)
    slow = float(data.get("compute_slowdown", 1.0))
    layers = tuple(replace(layer, forward_s=tuple(t * slow for t in layer.forward_s),
                           backward_s=tuple(t * slow for t in layer.backward_s)) for layer in profile.layers)
    return replace(profile, layers=layers, source="measured")


def optimizer_seconds(cluster: Cluster, parameter_bytes):
    """One optimizer step (gradient clipping, update, zeroing) over ``parameter_bytes``; 0 without a sheet."""
    data = calibration(cluster)
    if data is None:
        return 0.0 * parameter_bytes
    opt = data["optimizer"]
    return float(opt["step_overhead_s"]) + float(opt["seconds_per_parameter_byte"]) * parameter_bytes


def measured_allreduce(cluster: Cluster, nbytes, group: int):
    """Ring all-reduce from the measured sheet: 2 (n-1) steps of ``latency_s`` each plus 2 (n-1)/n of
    the bytes at the ring ``bandwidth`` (both derived from the fit on the measured group); None
    without a sheet."""
    data = calibration(cluster)
    if data is None:
        return None
    fit = data["allreduce"]
    return 2.0 * (group - 1) * float(fit["latency_s"]) + 2.0 * (group - 1) / group * nbytes / float(fit["bandwidth"])

