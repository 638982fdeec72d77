"""Who this rank is within its tensor-parallel group, and the divisibility rules of splitting."""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from models.errors import ConfigError


@dataclass(frozen=True)
class TensorParallel:
    """A tensor-parallel group as the layers see it. ``size == 1`` means no communication at all,
    so the same layers run in a single process (``group`` may then be None). ``sequence_parallel``:
    the regions between the tensor-parallel GEMMs hold 1/t of the sequence (``sequence.py``)."""

    group: dist.ProcessGroup | None = None
    rank: int = 0
    size: int = 1
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside a group of {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError("a tensor-parallel group of size > 1 needs a process group")

    def __deepcopy__(self, memo: dict) -> "TensorParallel":
        return self  # immutable, and a process group is a shared handle (it cannot be copied)

    @classmethod
    def single(cls) -> "TensorParallel":
        return cls()

    @classmethod
    def from_group(cls, group: dist.ProcessGroup, sequence_parallel: bool = False) -> "TensorParallel":
        """This rank's context in ``group`` (e.g. ``ProcessGroups.tp`` or ``mesh.get_group("tp")``)."""
        return cls(group=group, rank=dist.get_rank(group), size=dist.get_world_size(group),
                   sequence_parallel=sequence_parallel)


def divide(value: int, tp: int, key: str, hint: str) -> int:
    """``value / tp`` or a one-line ConfigError naming the key, the rule and a way out."""
    if value % tp:
        raise ConfigError(f"{key}={value} is not divisible by parallel.tp={tp}: {hint}")
    return value // tp


def padded_size(value: int, tp: int) -> int:
    """``value`` rounded up to a multiple of ``tp`` (the vocabulary is padded, not rejected)."""
    return -(-value // tp) * tp
