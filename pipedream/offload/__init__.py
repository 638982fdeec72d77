"""Host and device tiers for tensors that do not all fit on the compute device at once.

``HostTier`` holds the master copies (optionally in shared memory that every process on the
server maps, and pinned on CUDA); ``DeviceTier`` moves them to the compute device and back,
counts the bytes moved per tensor class and direction (``SwapCounters``), tracks the resident
bytes of what it holds (current and peak) and refuses, with one line, to exceed its budget.
Nothing here knows about schedules: the Harmony runtime is one user.
"""
from pipedream.offload.counters import Direction, SwapCounters, TensorClass
from pipedream.offload.device import DeviceBudgetError, DeviceTier, device_capacity_bytes
from pipedream.offload.host import HostTier

__all__ = ["DeviceBudgetError", "DeviceTier", "Direction", "HostTier", "SwapCounters", "TensorClass",
           "device_capacity_bytes"]
