"""Who this rank is within its context-parallel group, as the layers see it: each rank holds its
zigzag shard (``layout``) of every sample's sequence."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from models.context_parallel.layout import check_divisible, zigzag_indices
from models.errors import ConfigError
from models.group_context import GroupContext


@dataclass(frozen=True)
class ContextParallel(GroupContext):
    """A context-parallel group (``GroupContext``); ``size == 1`` splits nothing."""

    KIND: ClassVar[str] = "context-parallel"


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


def check_context_parallel_model(cp: ContextParallel, tp_size: int, seq_len: int, dropout: float = 0.0,
                                 sequence_parallel: bool = False) -> None:
    """One-line ConfigErrors for what a context-parallel family cannot build, before any layer is.
    With tensor parallelism the ring runs over the cp group on the rank's heads; with sequence
    parallelism the rank's zigzag shard (``seq_len / cp`` tokens) is further cut into ``tp_size`` parts."""
    check_no_dropout(dropout, cp)
    chunk = check_divisible(seq_len, cp.size)
    if sequence_parallel and tp_size > 1 and (2 * chunk) % tp_size:
        raise ConfigError(f"sequence length {seq_len} over cp={cp.size} leaves {2 * chunk} tokens per rank, which "
                          f"sequence parallelism cannot cut into tp={tp_size} equal parts: use a sequence length "
                          f"that is a multiple of {2 * cp.size * tp_size // math.gcd(2, tp_size)} or turn "
                          f"sequence parallelism off")
