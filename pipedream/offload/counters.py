"""Bytes moved between the tiers, per tensor class and direction (no torch)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class TensorClass(enum.Enum):
    WEIGHTS = "weights"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"


class Direction(enum.Enum):
    HOST_TO_DEVICE = "host_to_device"
    DEVICE_TO_HOST = "device_to_host"
    DEVICE_TO_DEVICE = "device_to_device"


@dataclass
class SwapCounters:
    """Running totals of bytes moved; ``snapshot``/``since`` give the volume of one interval."""

    moved: dict[tuple[TensorClass, Direction], int] = field(default_factory=dict)

    def add(self, cls: TensorClass, direction: Direction, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"bytes moved = {nbytes} must be >= 0")
        key = (cls, direction)
        self.moved[key] = self.moved.get(key, 0) + int(nbytes)

    def bytes(self, cls: TensorClass, direction: Direction) -> int:
        return self.moved.get((cls, direction), 0)

    def total(self, cls: TensorClass | None = None) -> int:
        return sum(n for (c, _), n in self.moved.items() if cls is None or c is cls)

    def snapshot(self) -> "SwapCounters":
        return SwapCounters(dict(self.moved))

    def since(self, earlier: "SwapCounters") -> "SwapCounters":
        return SwapCounters({k: n - earlier.moved.get(k, 0) for k, n in self.moved.items()
                             if n != earlier.moved.get(k, 0)})

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{class: {direction: bytes}}`` with every class and direction present (summary.json)."""
        return {c.value: {d.value: self.bytes(c, d) for d in Direction} for c in TensorClass}
