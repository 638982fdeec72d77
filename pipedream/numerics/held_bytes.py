"""Bytes of parameters, gradients and optimizer state one rank holds, measured from the tensors it
actually holds (each storage counted once, a freed zero3 parameter as 0 bytes), at rest (after a
step's update) and at their peak (sampled where each can peak: the SYNC, every reduce-scatter
launch and landing, every zero3 gather and per-layer reduce-scatter, the update; not zero3's
whole gather for a checkpoint or the end of training). summary.json reports both per rank
(``ranks[i].memory.held_bytes``)."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

KINDS = ("params", "grads", "optimizer")


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen, total = set(), 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


class HeldBytes:
    """``extra`` gives what the optimizer and the reduction hold besides the parameters and their
    ``.grad`` (shards, buffers in flight, state), as ``{kind: bytes}``."""

    def __init__(self, params: list[nn.Parameter], extra: Callable[[], dict[str, int]]):
        self.params, self.extra = params, extra
        self.rest: dict[str, int] | None = None
        self.peak = dict.fromkeys(KINDS, 0)

    def measure(self) -> dict[str, int]:
        extra = self.extra()
        return {"params": _storage_bytes(list(self.params)) + extra.get("params", 0),
                "grads": _storage_bytes([p.grad for p in self.params if p.grad is not None]) + extra.get("grads", 0),
                "optimizer": extra.get("optimizer", 0)}

    def sample(self, *_: Any) -> dict[str, int]:
        held = self.measure()
        for kind in KINDS:
            self.peak[kind] = max(self.peak[kind], held[kind])
        return held

    def at_rest(self) -> None:
        """Between steps: after the update (and, for zero1/2, with the parameters' gathers in flight)."""
        self.rest = self.sample()

    def report(self) -> dict[str, Any]:
        return {"rest": self.rest, "peak": dict(self.peak)}
