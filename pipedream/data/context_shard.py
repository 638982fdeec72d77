"""A context-parallel rank's part of every sample: the two zigzag chunks of each sequence it holds
(``models.context_parallel.layout``), inputs and targets alike. Token windows read only those
tokens from the corpus; any other dataset (a plugin's) is read whole and cut."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from models.context_parallel.layout import split_zigzag, zigzag_indices

from pipedream.data.datasets import TokenWindows


class ZigzagTokenWindows(torch.utils.data.Dataset):
    """``TokenWindows`` as rank ``rank`` of ``cp`` sees them: the inputs at its global positions of
    each window and their next tokens, gathered from the corpus at exactly those positions."""

    def __init__(self, windows: TokenWindows, cp: int, rank: int):
        self.windows = windows
        self.positions = zigzag_indices(windows.seq_len, cp, rank).numpy()

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        at = index * self.windows.seq_len + self.positions
        tokens = self.windows.tokens
        inputs = np.asarray(tokens[at], dtype=np.int64)
        targets = np.asarray(tokens[at + 1], dtype=np.int64)
        return torch.from_numpy(inputs), torch.from_numpy(targets)


class ZigzagSamples(torch.utils.data.Dataset):
    """Any dataset of (tokens, targets) pairs, each read whole and cut to rank ``rank``'s chunks."""

    def __init__(self, samples: torch.utils.data.Dataset, cp: int, rank: int):
        self.samples, self.cp, self.rank = samples, cp, rank

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        inputs, targets = self.samples[index]
        return (split_zigzag(inputs, self.cp, self.rank, 0), split_zigzag(targets, self.cp, self.rank, 0))


def context_shard(dataset: torch.utils.data.Dataset, cp: int, rank: int) -> torch.utils.data.Dataset:
    """``dataset`` as context-parallel rank ``rank`` of ``cp`` reads it (itself when cp = 1)."""
    if cp == 1:
        return dataset
    if isinstance(dataset, TokenWindows):
        return ZigzagTokenWindows(dataset, cp, rank)
    return ZigzagSamples(dataset, cp, rank)
