"""A generated task: the label of a sequence is the quantile of its mean token (class c when the
mean lies in the c-th of ``classes`` equal ranges of the vocabulary); sequences have random
lengths and are padded with token 0, which the mask tells apart from real tokens."""
from __future__ import annotations

import torch
from torch.utils.data import Dataset


class ModularSums(Dataset):
    def __init__(self, num_samples: int, seq_len: int, vocab: int, classes: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(seq_len // 4, seq_len + 1, (num_samples,), generator=generator)
        self.mask = torch.arange(seq_len) < lengths.unsqueeze(1)
        self.tokens = torch.randint(1, vocab, (num_samples, seq_len), generator=generator) * self.mask
        mean = self.tokens.sum(1) / lengths
        self.labels = (mean * classes / vocab).long().clamp(max=classes - 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        """((tokens, mask), label): the input is a tuple, so the first layer gets two arguments."""
        return (self.tokens[index], self.mask[index]), self.labels[index]


def build(num_samples: int = 1024, seq_len: int = 16, vocab: int = 32, classes: int = 4,
          val_fraction: float = 0.25, seed: int = 0) -> tuple[Dataset, Dataset]:
    """``data._target_=maskseq.data.build``: (train, validation)."""
    val = int(num_samples * val_fraction)
    return (ModularSums(num_samples - val, seq_len, vocab, classes, seed),
            ModularSums(val, seq_len, vocab, classes, seed + 1))
