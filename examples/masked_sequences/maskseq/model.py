"""Classifies variable-length token sequences. Every layer after the embedding takes and returns
(hidden states, padding mask), one tuple as ``nn.Sequential`` passes it, so two tensors cross each
pipeline boundary: the float hidden states (with a gradient) and the boolean mask (without one)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models import LayerModel, from_modules


def masked_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the valid positions of each sequence: (batch, seq, width) -> (batch, width)."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)


class Embed(nn.Module):
    def __init__(self, vocab: int, width: int, max_len: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(0.02 * torch.randn(max_len, width))

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, mask = inputs
        return self.tokens(tokens) + self.positions[: tokens.shape[1]], mask


class MixerBlock(nn.Module):
    """A residual MLP per position plus the sequence's masked mean, so positions see each other
    and padding never leaks in."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.context = nn.Linear(width, width)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, mask = inputs
        x = self.norm(hidden)
        mixed = self.down(F.gelu(self.up(x))) + self.context(masked_mean(x, mask)).unsqueeze(1)
        return hidden + mixed * mask.unsqueeze(-1).to(hidden.dtype), mask


class Classifier(nn.Module):
    def __init__(self, width: int, classes: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, classes)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden, mask = inputs
        return self.out(masked_mean(self.norm(hidden), mask))


def build(vocab: int = 32, width: int = 32, blocks: int = 2, max_len: int = 16, classes: int = 4) -> LayerModel:
    """``model._target_=maskseq.model.build``; ``model.width=64`` etc. override the arguments."""
    layers = nn.Sequential(Embed(vocab, width, max_len), *(MixerBlock(width) for _ in range(blocks)),
                           Classifier(width, classes))
    tokens = torch.randint(0, vocab, (2, max_len))
    example = ((tokens, torch.ones(2, max_len, dtype=torch.bool)), torch.randint(0, classes, (2,)))
    return from_modules(layers, F.cross_entropy, example, name="maskseq")
