"""The device tier: copies of host tensors on the compute device, under a byte budget.

Every tensor the tier holds is counted in ``resident_bytes`` (and ``peak_resident_bytes``) from
the moment its memory is taken until it is released, and nothing is taken that would lift the
count above ``budget_bytes``: the caller gets a ``DeviceBudgetError`` (one line) instead. On CUDA
host-to-device copies of prefetched tensors run on a side stream and the compute stream waits for
them on first use; on CPU the copies are synchronous but the bookkeeping is the same.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Hashable

import torch

from pipedream.errors import ConfigError
from pipedream.offload.counters import Direction, SwapCounters, TensorClass
from pipedream.offload.host import HostTier


class DeviceBudgetError(ConfigError):
    """A swap-in or allocation would exceed the device budget: the budget (or the packing) is the
    user's choice, so it is reported as one configuration line."""


def device_capacity_bytes(device: torch.device) -> int:
    """What the device holds: a GPU's total memory, or the machine's RAM for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class _Resident:
    tensor: torch.Tensor
    cls: TensorClass
    ready: torch.cuda.Event | None = None   # set while a prefetch copy may still run


class DeviceTier:
    def __init__(self, host: HostTier, device: torch.device | str = "cpu", budget_bytes: int | None = None):
        self.host = host
        self.device = torch.device(device)
        self.budget_bytes = device_capacity_bytes(self.device) if budget_bytes is None else int(budget_bytes)
        if self.budget_bytes <= 0:
            raise ValueError(f"device budget = {self.budget_bytes} bytes must be > 0")
        self.counters = SwapCounters()
        self.resident_bytes = 0
        self.peak_resident_bytes = 0
        self._resident: dict[Hashable, _Resident] = {}
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # --- accounting -------------------------------------------------------------------------
    def fits(self, nbytes: int) -> bool:
        return self.resident_bytes + nbytes <= self.budget_bytes

    def _reserve(self, key: Hashable, nbytes: int, cls: TensorClass) -> None:
        if key in self._resident:
            raise KeyError(f"{key!r} is already on the device")
        if not self.fits(nbytes):
            raise DeviceBudgetError(
                f"{nbytes} bytes of {cls.value} for {key!r} on top of {self.resident_bytes} resident exceed the "
                f"device budget of {self.budget_bytes} bytes; raise memory.device_budget_bytes or use smaller packs")
        self.resident_bytes += nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)

    def reset_peak(self) -> None:
        self.peak_resident_bytes = self.resident_bytes

    def __contains__(self, key: Hashable) -> bool:
        return key in self._resident

    def keys(self):
        return self._resident.keys()

    # --- moves ------------------------------------------------------------------------------
    def swap_in(self, key: Hashable, cls: TensorClass, host_key: Hashable | None = None) -> torch.Tensor:
        """The device copy of host tensor ``host_key`` (default: the same key) as ``key`` (copied now,
        or waited for if prefetched)."""
        entry = self._resident.get(key)
        if entry is None:
            source = self.host.get(key if host_key is None else host_key)
            self._reserve(key, source.nbytes, cls)
            tensor = torch.empty_like(source, device=self.device)
            tensor.copy_(source)
            self.counters.add(cls, Direction.HOST_TO_DEVICE, source.nbytes)
            entry = self._resident[key] = _Resident(tensor, cls)
        if entry.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.ready)
            entry.tensor.record_stream(torch.cuda.current_stream(self.device))
            entry.ready = None
        return entry.tensor

    def prefetch(self, key: Hashable, cls: TensorClass, host_key: Hashable | None = None) -> bool:
        """Start copying host tensor ``host_key`` (default: the same key) to the device as ``key``
        ahead of its use; False (nothing done) when it is already there or does not fit now: the
        later ``swap_in`` then copies it."""
        source = self.host.get(key if host_key is None else host_key)
        if key in self._resident or not self.fits(source.nbytes):
            return False
        self._reserve(key, source.nbytes, cls)
        if self._copy_stream is None:
            tensor = source.clone()
            ready = None
        else:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                tensor = torch.empty_like(source, device=self.device)
                tensor.copy_(source, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self._copy_stream)
        self.counters.add(cls, Direction.HOST_TO_DEVICE, source.nbytes)
        self._resident[key] = _Resident(tensor, cls, ready)
        return True

    def adopt(self, key: Hashable, tensor: torch.Tensor, cls: TensorClass) -> torch.Tensor:
        """Count a tensor made on the device (a gradient, a received activation) as resident."""
        self._reserve(key, tensor.nbytes, cls)
        self._resident[key] = _Resident(tensor, cls)
        return tensor

    def allocate(self, key: Hashable, shape, dtype: torch.dtype, cls: TensorClass) -> torch.Tensor:
        """A zero-filled device tensor counted as resident (the budget is checked first)."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        self._reserve(key, nbytes, cls)
        tensor = torch.zeros(shape, dtype=dtype, device=self.device)
        self._resident[key] = _Resident(tensor, cls)
        return tensor

    def get(self, key: Hashable) -> torch.Tensor:
        """The device tensor of ``key`` (waiting for its prefetch if one runs)."""
        return self.swap_in(key, self._entry(key).cls)

    def _entry(self, key: Hashable) -> _Resident:
        entry = self._resident.get(key)
        if entry is None:
            raise KeyError(f"{key!r} is not on the device")
        return entry

    def swap_out(self, key: Hashable, *, write_back: bool = True, host_key: Hashable | None = None) -> None:
        """Release ``key``; with ``write_back`` copy it to host tensor ``host_key`` (default: the same
        key, allocated on first use) first. Without it the device copy is dropped (the host copy is
        still current, e.g. weights that were only read)."""
        entry = self._entry(key)
        del self._resident[key]
        if entry.ready is not None:
            entry.ready.synchronize()
        if write_back:
            target_key = key if host_key is None else host_key
            target = (self.host.get(target_key) if target_key in self.host
                      else self.host.allocate(target_key, entry.tensor.shape, entry.tensor.dtype))
            target.copy_(entry.tensor)
            self.counters.add(entry.cls, Direction.DEVICE_TO_HOST, entry.tensor.nbytes)
        self.resident_bytes -= entry.tensor.nbytes

    def release(self, key: Hashable) -> torch.Tensor:
        """Stop counting ``key`` (and hand the tensor back, e.g. to send it); no copy."""
        entry = self._entry(key)
        del self._resident[key]
        self.resident_bytes -= entry.tensor.nbytes
        return entry.tensor

    def record_device_to_device(self, cls: TensorClass, nbytes: int) -> None:
        """Count a tensor sent straight to another device (the caller does the sending)."""
        self.counters.add(cls, Direction.DEVICE_TO_DEVICE, nbytes)
