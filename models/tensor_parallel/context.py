"""Who this rank is within its tensor-parallel group, and the divisibility rules of splitting."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch.distributed as dist

from models.errors import ConfigError
from models.group_context import GroupContext


@dataclass(frozen=True)
class TensorParallel(GroupContext):
    """A tensor-parallel group as the layers see it (``GroupContext``). ``sequence_parallel``: the
    regions between the tensor-parallel GEMMs hold 1/t of the sequence (``sequence.py``)."""

    KIND: ClassVar[str] = "tensor-parallel"

    sequence_parallel: bool = False

    @classmethod
    def single(cls) -> "TensorParallel":
        return cls()

    @classmethod
    def from_group(cls, group: dist.ProcessGroup, sequence_parallel: bool = False) -> "TensorParallel":
        """This rank's context in ``group`` (e.g. ``ProcessGroups.tp`` or ``mesh.get_group("tp")``)."""
        return super().from_group(group, sequence_parallel=sequence_parallel)


def divide(value: int, tp: int, key: str, hint: str) -> int:
    """``value / tp`` or a one-line ConfigError naming the key, the rule and a way out."""
    if value % tp:
        raise ConfigError(f"{key}={value} is not divisible by parallel.tp={tp}: {hint}")
    return value // tp


def padded_size(value: int, tp: int) -> int:
    """``value`` rounded up to a multiple of ``tp`` (the vocabulary is padded, not rejected)."""
    return -(-value // tp) * tp
