"""Who this rank is within one process group, as layers see it: the common part of the tensor-,
context- and expert-parallel contexts (``models.tensor_parallel.TensorParallel``,
``models.context_parallel.ContextParallel``, ``models.expert_parallel.ExpertParallel``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self, TypeVar

import torch.distributed as dist


@dataclass(frozen=True)
class GroupContext:
    """``size == 1`` means no communication at all, so the same layers run in a single process
    (``group`` may then be None)."""

    KIND: ClassVar[str] = "process-group"   # named in the errors: "tensor-parallel", "context-parallel"

    group: dist.ProcessGroup | None = None
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"{self.KIND} rank {self.rank} outside a group of {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError(f"a {self.KIND} group of size > 1 needs a process group")

    @classmethod
    def from_group(cls, group: dist.ProcessGroup, **fields: Any) -> Self:
        """This rank's context in ``group`` (``fields``: a subclass's own settings)."""
        return cls(group=group, rank=dist.get_rank(group), size=dist.get_world_size(group), **fields)

    def __deepcopy__(self, memo: dict) -> "GroupContext":
        return self  # immutable, and a process group is a shared handle (it cannot be copied)


Context = TypeVar("Context", bound=GroupContext)


def splitting(context: Context | None) -> Context | None:
    """``context`` when its group splits the work (size > 1), else None: a group of one builds the
    plain model."""
    return context if context is not None and context.size > 1 else None
