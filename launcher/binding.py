"""``launcher.bind_cores``: which CPU cores each local rank runs on (``pipedream.runtime.affinity``).

* ``auto`` (default): on a CPU node with at least as many cores as local ranks, one disjoint set per
  rank (the cores this launcher may use, split evenly in order); with fewer cores, no binding. On a
  GPU node, torchrun's ``--numa-binding=node`` binds each rank to the CPUs of its GPU's NUMA node
  (where ``numactl`` is installed; otherwise GPU ranks are not bound).
* ``false``: no binding.
* a list of core lists, one per local rank (``[[0,1],[2,3]]``): those sets, checked before launch.

A bound rank runs its intra-op threads on its set: ``len(set)`` threads (``train.threads`` where
nothing is bound).
"""
from __future__ import annotations

from typing import Any, Sequence

from pipedream.errors import ConfigError
from pipedream.runtime.affinity import even_sets

NUMA_BINDING = "--numa-binding=node"   # torchrun's option (torch 2.13): CPUs near each rank's GPU


def _plain(value: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _cores(text: Sequence[int]) -> str:
    return ",".join(str(c) for c in sorted(text))


def core_sets(setting: Any, device: str, ranks: int, available: Sequence[int]) -> list[tuple[int, ...]] | None:
    """The core set of each of ``ranks`` local ranks, or None (no binding by this launcher);
    ``available``: the cores this process may run on (``os.sched_getaffinity``)."""
    setting = _plain(setting)
    if setting is False:
        return None
    if setting == "auto":
        if device != "cpu" or len(available) < ranks:
            return None
        return even_sets(available, ranks)
    rule = ("must be auto, false or a list of core lists, one per local rank (e.g. launcher.bind_cores=[[0],[1]])")
    if not isinstance(setting, list) or not all(
            isinstance(s, list) and s and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in s)
            for s in setting):
        raise ConfigError(f"launcher.bind_cores={setting!r} {rule}")
    if len(setting) != ranks:
        raise ConfigError(f"launcher.bind_cores={setting} has {len(setting)} core sets for {ranks} processes on "
                          f"this node: give one per local rank, or launcher.bind_cores=auto")
    missing = sorted({c for s in setting for c in s} - set(available))
    if missing:
        raise ConfigError(f"launcher.bind_cores={setting}: cores {missing} are not available here (cores "
                          f"{_cores(available)}): choose among those, or launcher.bind_cores=auto")
    seen: set[int] = set()
    for cores in setting:
        shared = seen & set(cores)
        if shared:
            raise ConfigError(f"launcher.bind_cores={setting}: core {min(shared)} is in two sets: give each local "
                              f"rank cores of its own")
        seen |= set(cores)
    return [tuple(s) for s in setting]


def numa_options(setting: Any, device: str) -> list[str]:
    """torchrun's options for ``setting``: NUMA binding of GPU ranks under ``auto``, where the
    ``numactl`` it runs each rank under is installed (without it torchrun's binding fails the
    launch: the ranks stay unbound)."""
    import shutil

    gpu_auto = _plain(setting) == "auto" and device != "cpu"
    return [NUMA_BINDING] if gpu_auto and shutil.which("numactl") else []
