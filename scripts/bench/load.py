"""The benchmarks' view of other processes on a shared machine: how much of the CPU they used
while a timed block ran, and waiting (within a budget) until they leave the CPU alone."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist


def cpu_busy_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine from /proc/stat; (0, 0) where unavailable."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def other_load(before: tuple[int, int], after: tuple[int, int], own_cpu_s: float) -> float | None:
    """Share of the machine's CPU that processes other than the benchmark used while it ran."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy, total = after[0] - before[0], after[1] - before[1]
    if total <= 0:
        return None
    return max(0.0, (busy - own_cpu_s * ticks) / total)


@dataclass
class Quiet:
    """Before a timed block, rank 0 waits (within a budget for the whole benchmark) until other
    processes leave the CPU alone; the other ranks wait in a barrier, using no CPU."""

    max_other_load: float
    budget_s: float
    waited_s: float = 0.0

    def wait(self, rank: int) -> None:
        if rank == 0:
            while self.waited_s < self.budget_s:
                before = cpu_busy_jiffies()
                time.sleep(0.5)
                self.waited_s += 0.5
                if (other_load(before, cpu_busy_jiffies(), 0.0) or 0.0) <= self.max_other_load:
                    break
        dist.barrier()


def measured(run: Callable[[], None]) -> tuple[float, float]:
    """(seconds, other processes' CPU share) of ``run`` between two barriers; rank 0's view."""
    dist.barrier()
    jiffies, cpu, start = cpu_busy_jiffies(), time.process_time(), time.perf_counter()
    run()
    dist.barrier()
    elapsed = time.perf_counter() - start
    own = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
    dist.all_reduce(own)                                   # CPU seconds of every benchmark process
    load = torch.tensor([other_load(jiffies, cpu_busy_jiffies(), float(own)) or 0.0], dtype=torch.float64)
    dist.broadcast(load, src=0)
    return elapsed, float(load)
