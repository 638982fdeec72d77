"""Who this rank is within its context-parallel group, as the layers see it: each rank holds its
zigzag shard (``layout``) of every sample's sequence."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from models.context_parallel.layout import check_divisible, zigzag_indices
from models.errors import ConfigError
from models.group_context import GroupContext


@dataclass(frozen=True)
class ContextParallel(GroupContext):
    """A context-parallel group (``GroupContext``); ``size == 1`` splits nothing."""

    KIND: ClassVar[str] = "context-parallel"

    @classmethod
    def from_group(cls, group: dist.ProcessGroup) -> "ContextParallel":
        """This rank's context in ``group``."""
        return cls(group=group, rank=dist.get_rank(group), size=dist.get_world_size(group))


def splitting(cp: ContextParallel | None) -> ContextParallel | None:
    """``cp`` when it splits the sequence (size > 1), else None: a group of one builds the plain model."""
    return cp if cp is not None and cp.size > 1 else None


def global_positions(local_len: int, cp: ContextParallel | None, device: torch.device) -> torch.Tensor:
    """The global positions (int64) of the ``local_len`` tokens this rank holds: 0..local_len-1
    without context parallelism, its zigzag indices of the ``local_len · cp`` sequence with it."""
    if cp is None:
        return torch.arange(local_len, device=device)
    return zigzag_indices(local_len * cp.size, cp.size, cp.rank).to(device)


def check_no_dropout(dropout: float, cp: ContextParallel) -> None:
    if dropout > 0.0:
        raise ConfigError(f"dropout={dropout} with context parallelism cp={cp.size}: ring attention has no "
                          f"dropout; set model.dropout=0 or use cp=1")


def check_context_parallel_model(cp: ContextParallel, tp_size: int, seq_len: int, dropout: float = 0.0) -> None:
    """One-line ConfigErrors for what a context-parallel family cannot build, before any layer is."""
    check_no_dropout(dropout, cp)
    if tp_size > 1:   # GPT's tensor-parallel attention and sequence-parallel positions know no cp yet
        raise ConfigError(f"tensor parallelism tp={tp_size} with context parallelism cp={cp.size} is not "
                          f"supported yet: use tp=1 or cp=1")
    check_divisible(seq_len, cp.size)

