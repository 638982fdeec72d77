"""A GPT decoder (pre-LayerNorm, causal attention, GELU MLP, learned positions) as a list of layers:
[embedding, block_0 .. block_{L-1}, head (final LayerNorm + vocabulary projection)]."""
from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .spec import LayerModel, seeded

INIT_STD = 0.02


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, seq_len: int, dropout: float):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, hidden)
        self.wpe = nn.Embedding(seq_len, hidden)
        self.drop = nn.Dropout(dropout)
        nn.init.normal_(self.wte.weight, std=INIT_STD)
        nn.init.normal_(self.wpe.weight, std=INIT_STD)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.wte(tokens) + self.wpe(positions))


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, dropout: float, proj_std: float):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)
        nn.init.normal_(self.qkv.weight, std=INIT_STD)
        nn.init.normal_(self.proj.weight, std=proj_std)
        nn.init.zeros_(self.qkv.bias)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).split(hidden, dim=2)
        shape = (batch, seq, self.num_heads, hidden // self.num_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(batch, seq, hidden)))


class MLP(nn.Module):
    def __init__(self, hidden: int, dropout: float, proj_std: float):
        super().__init__()
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(dropout)
        nn.init.normal_(self.fc.weight, std=INIT_STD)
        nn.init.normal_(self.proj.weight, std=proj_std)
        nn.init.zeros_(self.fc.bias)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, hidden: int, num_heads: int, dropout: float, num_layers: int):
        super().__init__()
        proj_std = INIT_STD / math.sqrt(2 * num_layers)  # GPT-2: scale residual projections
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, num_heads, dropout, proj_std)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, dropout, proj_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits (no bias, so it can be tied)."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.ln_f = nn.LayerNorm(hidden)
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden))
        nn.init.normal_(self.weight, std=INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln_f(x), self.weight)


def language_model_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def gpt_model(num_layers: int, hidden_size: int, num_heads: int, seq_len: int, vocab_size: int = 256,
              tie_embeddings: bool = True, dropout: float = 0.0, seed: int = 0) -> LayerModel:
    """GPT as ``num_layers + 2`` pipeline layers. With tying, the head starts from (and stays
    equal to) the token embedding."""
    last = num_layers + 1

    def build_layer(i: int) -> nn.Module:
        if i == 0:
            return seeded(seed, partial(Embedding, vocab_size, hidden_size, seq_len, dropout))
        if i == last:
            head = seeded(seed + i, partial(Head, vocab_size, hidden_size))
            if tie_embeddings:  # same values as the embedding's table, drawn from its seed
                with torch.no_grad():
                    head.weight.copy_(seeded(seed, partial(Embedding, vocab_size, hidden_size, seq_len,
                                                           dropout)).wte.weight)
            return head
        return seeded(seed + i, partial(Block, hidden_size, num_heads, dropout, num_layers))

    def make_batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(vocab_size, (batch_size, seq_len + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]

    tied = (((0, "wte.weight"), (last, "weight")),) if tie_embeddings else ()
    return LayerModel(name="gpt", num_layers=num_layers + 2, build_layer=build_layer,
                      loss_fn=language_model_loss, make_batch=make_batch, tied=tied)
