"""Global batches and micro-batches: which samples each step and rank take, and how samples are
stacked (tuples member by member)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class GlobalBatchOrder:
    """Which samples form global batch ``step``: a fresh permutation per epoch, seeded.

    Every rank computes the same order; data-parallel rank d of D takes the d-th contiguous slice,
    so the shards are disjoint and the union is exactly the single-process batch.
    """

    dataset_size: int
    global_batch: int
    seed: int
    # epoch -> its permutation: drawn once, not at every step (a draw costs O(dataset size)); at most
    # the two epochs a batch can be reading from are kept
    _drawn: dict[int, np.ndarray] = field(default_factory=dict, init=False, repr=False, compare=False)

    def indices(self, step: int) -> list[int]:
        start = step * self.global_batch
        positions = np.arange(start, start + self.global_batch)
        epochs, offsets = np.divmod(positions, self.dataset_size)
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):  # a batch spans at most a few epochs
            mask = epochs == epoch
            out[mask] = self._permutation(int(epoch))[offsets[mask]]
        return out.tolist()

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._drawn:
            for older in [e for e in self._drawn if e < epoch - 1]:
                del self._drawn[older]
            self._drawn[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.dataset_size)
        return self._drawn[epoch]

    def shard(self, step: int, dp_rank: int, dp: int) -> list[int]:
        indices = self.indices(step)
        size = self.global_batch // dp
        return indices[dp_rank * size:(dp_rank + 1) * size]


def collate(dataset: torch.utils.data.Dataset, indices: list[int]) -> tuple[Any, Any]:
    """Stacks samples into a batch; an input or target that is a tuple of tensors is stacked member
    by member (a tuple of batches)."""
    inputs, targets = zip(*(dataset[i] for i in indices))
    return _stack(inputs), _stack(targets)


def _stack(samples: tuple) -> Any:
    if isinstance(samples[0], (tuple, list)):
        return tuple(torch.stack(member) for member in zip(*samples))
    return torch.stack(samples)


def microbatches(dataset: torch.utils.data.Dataset, indices: list[int], micro_batch: int
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Splits one rank's shard into consecutive micro-batches."""
    return [collate(dataset, indices[i:i + micro_batch]) for i in range(0, len(indices), micro_batch)]
