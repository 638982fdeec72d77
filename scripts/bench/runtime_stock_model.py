"""The runtime benchmark's third model, built only from torch's own modules and loaded as a plugin
(``model._target_=scripts.bench.runtime_stock_model.build``, as a user's model would be): a token
embedding, ``nn.TransformerEncoderLayer`` blocks (post-LayerNorm, ReLU, no dropout) and a
LayerNorm + Linear head. None of it is one of this repository's layers: the attention's
projections go through ``F.multi_head_attention_forward``, not through an ``nn.Linear`` call."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from models import LayerModel, from_modules


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position: (batch, seq, vocab) logits against (batch, seq) tokens."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(vocab: int = 256, width: int = 128, heads: int = 4, blocks: int = 4, seq_len: int = 64) -> LayerModel:
    """``model._target_=scripts.bench.runtime_stock_model.build``; ``model.width=...`` etc. override."""
    layers = nn.Sequential(
        nn.Embedding(vocab, width),
        *(nn.TransformerEncoderLayer(width, heads, dim_feedforward=4 * width, dropout=0.0, batch_first=True)
          for _ in range(blocks)),
        nn.Sequential(nn.LayerNorm(width), nn.Linear(width, vocab)))
    tokens = torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(0))
    tokens[0, :2] = torch.tensor([0, vocab - 1])   # random batches draw from the example's range: all of it
    return from_modules(layers, token_loss, (tokens, tokens.roll(-1, dims=1)), name="stock_transformer")


def data(vocab: int = 256, seq_len: int = 64, samples: int = 64) -> tuple[TensorDataset, TensorDataset]:
    """``data._target_=scripts.bench.runtime_stock_model.data``: random token sequences and their
    next tokens (the benchmark feeds the model's own random batches; the run's checks want data)."""
    generator = torch.Generator().manual_seed(0)

    def split() -> TensorDataset:
        tokens = torch.randint(0, vocab, (samples, seq_len + 1), generator=generator)
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return split(), split()
