"""Hierarchical topologies and the device they are built of: what the cost model needs to know
about a cluster. The vendor sheets live in ``pipedream.devices``; ``local_cpu`` is measured here.

A topology is a list of levels from the device up (dissertation ch. 2.4.1, Figure 2.6): level k
groups ``count`` components of level k-1 joined by links of ``bandwidth`` bytes/s (what one
device gets when it talks across that level).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from pipedream.devices import DEVICES, GIB, DeviceSheet
from pipedream.observe.host import cache_dir, cached_flops, cpu_model, write_cache

from planner.errors import PlannerError


def measure_local_cpu(devices: int = 1, seconds: float = 0.2, cache: Path | None = None) -> DeviceSheet:
    """The machine we run on: fp32 matmul FLOP/s and RAM, shared by ``devices`` processes. The
    FLOP/s are measured once per host, CPU, core count and torch version and kept in
    ``local_cpu.json`` beside the runtime's peak cache (``PIPEDREAM_CACHE_DIR``, default
    ``~/.cache/pipedream``): later dry runs neither import torch nor time anything. Delete the file to
    measure again (say, after measuring on a busy machine)."""
    path = cache or cache_dir() / "local_cpu.json"
    key = _host_key()
    flops = cached_flops(path, key)
    if flops is None:
        flops = _matmul_flops(seconds)
        _cache_flops(path, key, flops)
    memory = _total_ram_bytes()
    return DeviceSheet("local_cpu", memory / devices, MappingProxyType({"fp32": flops / devices}),
                       20e9 / devices, "fp32", 1.0, 1e6)


def _matmul_flops(seconds: float) -> float:
    import torch  # local import: the rest of the planner runs without torch

    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - start)


def _host_key() -> str:
    """What the measured speed depends on, read without importing torch."""
    import importlib.metadata   # here: with email and socket, a hundredth of a second every plan would pay
    import socket

    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "none"
    return f"{socket.gethostname()}|{cpu_model()}|cores={len(os.sched_getaffinity(0))}|torch={torch_version}"


def _cache_flops(path: Path, key: str, flops: float) -> None:
    try:
        write_cache(path, key, flops)
    except OSError:   # a read-only home only means measuring again next time
        pass


def _total_ram_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8.0 * GIB


@dataclass(frozen=True)
class Level:
    """``count`` components of the level below, joined by links of ``bandwidth`` bytes/s per device;
    ``node_bandwidth`` is what all NICs of one node carry together (None: bandwidth x devices per node)."""

    name: str
    count: int
    bandwidth: float
    latency: float = 0.0
    node_bandwidth: float | None = None


@dataclass(frozen=True)
class Cluster:
    name: str
    device: DeviceSheet
    levels: tuple[Level, ...]
    devices_per_node: int
    runtime_device: str = "cuda"
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def num_devices(self) -> int:
        return math.prod(level.count for level in self.levels)

    @property
    def nodes(self) -> int:
        return self.num_devices // self.devices_per_node

    def level_for_span(self, span: int) -> Level:
        """The lowest level whose components hold ``span`` consecutive devices."""
        covered = 1
        for level in self.levels:
            covered *= level.count
            if span <= covered:
                return level
        return self.levels[-1]

    def bandwidth_for_span(self, span: int) -> float:
        return self.level_for_span(max(span, 1)).bandwidth


def device_sheet(name: str, devices: int = 1) -> DeviceSheet:
    if name == "local_cpu":
        return measure_local_cpu(devices)
    if name not in DEVICES:
        raise PlannerError(f"cluster.sheet={name!r} is not a known device; choose one of "
                           f"{sorted(DEVICES) + ['local_cpu']}")
    return DEVICES[name]


def cluster_from_config(cfg: Mapping[str, Any], sheet: DeviceSheet | None = None) -> Cluster:
    """Build a Cluster from a ``conf/cluster/*.yaml`` mapping (keys documented in docs/planner.md)."""
    if cfg.get("sheet") == "measured":  # planner.config reads those through cluster_sheet
        raise PlannerError("cluster.sheet=measured is read with planner.config.cluster_for, not as a preset")
    name = str(cfg.get("name", "cluster"))
    nodes = int(cfg.get("nodes", 1))
    per_node = int(cfg.get("devices_per_node", 1))
    if nodes < 1 or per_node < 1:
        raise PlannerError(f"cluster {name}: nodes = {nodes} and devices_per_node = {per_node} must be >= 1")
    raw_levels = list(cfg.get("levels") or [{"name": "local", "bandwidth_gbit_s": 100}])
    levels = []
    for k, raw in enumerate(raw_levels):
        bandwidth = float(raw["bandwidth_gbit_s"]) * 1e9 / 8  # Gbit/s -> bytes/s
        latency = float(raw.get("latency_us", 0.0)) * 1e-6
        nics = raw.get("nics_per_node")
        node_bw = float(nics) * float(raw.get("nic_gbit_s", raw["bandwidth_gbit_s"])) * 1e9 / 8 if nics else None
        if k == 0:
            count = per_node
        elif k == len(raw_levels) - 1:
            count = nodes // math.prod(int(r["count"]) for r in raw_levels[1:-1]) if len(raw_levels) > 2 else nodes
        else:
            count = int(raw["count"])
        levels.append(Level(str(raw.get("name", f"level{k}")), max(count, 1), bandwidth, latency, node_bw))
    if len(raw_levels) == 1 and nodes > 1:
        levels.append(Level("network", nodes, levels[0].bandwidth, levels[0].latency))
    sheet_name = str(cfg.get("sheet", "local_cpu" if cfg.get("device") == "cpu" else "a100_80gb"))
    sheet = sheet or device_sheet(sheet_name, per_node)
    if "memory_gib" in cfg and cfg["memory_gib"] is not None:
        sheet = replace(sheet, memory_bytes=float(cfg["memory_gib"]) * GIB)
    host = cfg.get("host_bandwidth_gbit_s")   # host <-> device per device (PCIe), for Harmony's swaps
    extra = MappingProxyType({"host_bandwidth": float(host) * 1e9 / 8}) if host else MappingProxyType({})
    cluster = Cluster(name, sheet, tuple(levels), per_node, str(cfg.get("device", "cuda")), extra)
    if cluster.num_devices != nodes * per_node:
        raise PlannerError(f"cluster {name}: levels multiply to {cluster.num_devices} devices but "
                           f"nodes * devices_per_node = {nodes * per_node}; fix the middle levels' counts")
    return cluster
