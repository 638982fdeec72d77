"""A GPT decoder (pre-LayerNorm, causal attention, GELU MLP, learned positions) as a list of layers:
[embedding, block_0 .. block_{L-1}, head (final LayerNorm + vocabulary projection)]."""
from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import CoreAttention
from models.context_parallel import ContextParallel, global_positions
from models.group_context import splitting
from models.context_parallel.context import check_context_parallel_model
from models.errors import ConfigError
from models.tensor_parallel import (RNGTracker, ShardSpec, TensorParallel, VocabParallelEmbedding, divide,
                                       mark_replicated, mark_sharded, parallelize_block, shard_tensor,
                                       vocab_parallel_cross_entropy, vocab_parallel_logits)

from models.tensor_parallel.sequence import SequenceParallelLayerNorm, sequence_parallel_weight, sequence_range
from models.tensor_parallel.transformer import sequence_region_dropout

from models.families.transformer_facts import OPTIONAL_KEYS, option, transformer_pipeline_layers
from models.spec import LayerModel, seeded

INIT_STD = 0.02


class Embedding(nn.Module):
    """Token plus learned position embeddings; with ``cp`` the tokens are this rank's zigzag shard,
    so the positions are its global ones."""

    def __init__(self, vocab_size: int, hidden: int, seq_len: int, dropout: float, cp: ContextParallel | None = None):
        super().__init__()
        self.cp = cp
        self.wte = nn.Embedding(vocab_size, hidden)
        self.wpe = nn.Embedding(seq_len, hidden)
        self.drop = nn.Dropout(dropout)
        nn.init.normal_(self.wte.weight, std=INIT_STD)
        nn.init.normal_(self.wpe.weight, std=INIT_STD)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = global_positions(tokens.shape[1], self.cp, tokens.device)
        return self.drop(self.wte(tokens) + self.wpe(positions))


class SequenceParallelEmbedding(nn.Module):
    """The tensor-parallel embedding with sequence parallelism: the vocabulary-parallel lookup is
    reduce-scattered so each rank holds its part of the sequence, which gets its own positions
    (with ``cp``, its part of the rank's zigzag shard, at their global positions)."""

    def __init__(self, embedding: Embedding, tp: TensorParallel, rng: RNGTracker):
        super().__init__()
        self.tp, self.rng = tp, rng
        self.wte = VocabParallelEmbedding.from_dense_weight(embedding.wte.weight.detach(), tp)
        self.wpe, self.drop, self.cp = embedding.wpe, embedding.drop, embedding.cp

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        start, end = sequence_range(tokens.shape[1], self.tp)
        positions = global_positions(tokens.shape[1], self.cp, tokens.device)[start:end]
        x = self.wte(tokens) + F.embedding(positions, sequence_parallel_weight(self.wpe.weight, self.tp))
        return sequence_region_dropout(self.drop, x, self.rng, self.tp)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention; ``causal=False`` makes it bidirectional (BERT). ``cp``: ring
    attention over the context-parallel group."""

    def __init__(self, hidden: int, num_heads: int, dropout: float, proj_std: float, causal: bool = True,
                 cp: ContextParallel | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.causal = causal
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.dropout = dropout
        self.core = CoreAttention(causal, dropout, cp)
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
        y = self.core(q, k, v)
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
    def __init__(self, hidden: int, num_heads: int, dropout: float, num_layers: int,
                 cp: ContextParallel | None = None):
        super().__init__()
        proj_std = INIT_STD / math.sqrt(2 * num_layers)  # GPT-2: scale residual projections
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, num_heads, dropout, proj_std, cp=cp)
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


class ParallelHead(nn.Module):
    """Tensor-parallel head: the replicated final LayerNorm, then this rank's slice of the
    (padded) vocabulary; the logits stay split for ``vocab_parallel_cross_entropy``."""

    def __init__(self, head: Head, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.ln_f = SequenceParallelLayerNorm(head.ln_f, tp) if tp.sequence_parallel else head.ln_f
        spec = ShardSpec(dim=0, full_size=head.weight.shape[0])
        self.weight = mark_sharded(nn.Parameter(shard_tensor(head.weight.detach(), spec, tp)), spec)
        mark_replicated(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(self.ln_f(x), self.weight, self.tp)


def language_model_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def parallel_language_model_loss(logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel,
                                 vocab_size: int) -> torch.Tensor:
    """``language_model_loss`` on vocabulary-parallel logits (targets -100 are ignored as there)."""
    return vocab_parallel_cross_entropy(logits, targets, tp, vocab_size)


def check_tensor_parallel(hidden_size: int, num_heads: int, tp: int) -> None:
    """One-line ConfigError unless heads (and so hidden and the 4h MLP) split evenly over ``tp``
    ranks; the vocabulary is padded to a multiple of t instead. Needs no process group, so a
    configuration can be checked before any is created."""
    if hidden_size % num_heads:
        raise ConfigError(f"model.hidden_size={hidden_size} is not divisible by model.num_heads={num_heads}: "
                          f"choose a hidden size that is a multiple of the head count")
    divide(num_heads, tp, "model.num_heads", "choose parallel.tp dividing the number of attention heads")
    divide(hidden_size, tp, "model.hidden_size", "choose parallel.tp dividing the hidden size")


def check_tensor_parallel_config(model_cfg: Any, tp: int) -> None:
    """The family's tensor-parallel check (``models.registry``) on a ``model`` config, GPT and BERT alike."""
    check_tensor_parallel(int(model_cfg["hidden_size"]), int(model_cfg["num_heads"]), tp)


def parallelize_gpt_layer(layer: nn.Module, tp: TensorParallel, rng: RNGTracker) -> nn.Module:
    """The tensor-parallel form of a dense GPT layer: exactly its slice on this rank. (A model too big
    for one device would initialise the shards directly under ``rng.fork`` instead of slicing.)"""
    if isinstance(layer, Embedding) and tp.sequence_parallel:
        return mark_replicated(SequenceParallelEmbedding(layer, tp, rng))
    if isinstance(layer, Embedding):
        layer.wte = VocabParallelEmbedding.from_dense_weight(layer.wte.weight.detach(), tp)
        return mark_replicated(layer)
    if isinstance(layer, Head):
        return ParallelHead(layer, tp)
    return parallelize_block(layer, tp, rng)


def gpt_model(num_layers: int, hidden_size: int, num_heads: int, seq_len: int,
              vocab_size: int = OPTIONAL_KEYS["vocab_size"], tie_embeddings: bool = OPTIONAL_KEYS["tie_embeddings"],
              dropout: float = OPTIONAL_KEYS["dropout"], seed: int = 0,
              tp: TensorParallel | None = None, cp: ContextParallel | None = None) -> LayerModel:
    """GPT as ``num_layers + 2`` pipeline layers. With tying, the head starts from (and stays
    equal to) the token embedding. With ``tp``, every layer is this rank's slice of the dense layer
    (same seed) and the loss is the vocabulary-parallel cross-entropy. With ``cp`` (size > 1) the
    layers take this rank's zigzag shard of each sequence (``split_zigzag``); the same parameters,
    and the loss is the local mean."""
    last = num_layers + 1
    if tp is not None:
        check_tensor_parallel(hidden_size, num_heads, tp.size)
    cp = splitting(cp)
    if cp is not None:
        check_context_parallel_model(cp, 1 if tp is None else tp.size, seq_len, dropout,
                                     tp is not None and tp.sequence_parallel)
    embedding = partial(Embedding, vocab_size, hidden_size, seq_len, dropout, cp)

    def build_layer(i: int) -> nn.Module:
        dense = build_dense_layer(i)
        return dense if tp is None else parallelize_gpt_layer(dense, tp, RNGTracker(seed + i, tp.rank))

    def build_dense_layer(i: int) -> nn.Module:
        if i == 0:
            return seeded(seed, embedding)
        if i == last:
            head = seeded(seed + i, partial(Head, vocab_size, hidden_size))
            if tie_embeddings:  # same values as the embedding's table, drawn from its seed
                with torch.no_grad():
                    head.weight.copy_(seeded(seed, embedding).wte.weight)
            return head
        return seeded(seed + i, partial(Block, hidden_size, num_heads, dropout, num_layers, cp))

    def make_batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(vocab_size, (batch_size, seq_len + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]

    tied = (((0, "wte.weight"), (last, "weight")),) if tie_embeddings else ()
    loss_fn = language_model_loss if tp is None else partial(parallel_language_model_loss, tp=tp,
                                                             vocab_size=vocab_size)
    return LayerModel(name="gpt", num_layers=transformer_pipeline_layers(num_layers), build_layer=build_layer,
                      loss_fn=loss_fn, make_batch=make_batch, tied=tied)


def transformer_sizes(model_cfg: Any) -> dict[str, Any]:
    """The keyword arguments GPT and BERT share, read from a ``model`` config."""
    return dict(num_layers=int(model_cfg["num_layers"]), hidden_size=int(model_cfg["hidden_size"]),
                num_heads=int(model_cfg["num_heads"]), seq_len=int(model_cfg["seq_len"]),
                vocab_size=int(option(model_cfg, "vocab_size")), tie_embeddings=bool(option(model_cfg, "tie_embeddings")),
                dropout=float(option(model_cfg, "dropout")))


def gpt_from_config(model_cfg: Any, seed: int = 0, tp: TensorParallel | None = None,
                    cp: ContextParallel | None = None) -> LayerModel:
    """``model=gpt_*`` (``models.registry``)."""
    return gpt_model(**transformer_sizes(model_cfg), seed=seed, tp=tp, cp=cp)
