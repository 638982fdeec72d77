"""Megatron's split of a transformer layer (dissertation ch. 4.2.3, fig. 4.5): self-attention with
whole heads per rank (column-parallel [q; k; v], row-parallel output projection) and the MLP with
its first GEMM split by columns and its second by rows. Per layer: two all-reduces forward (g after
each row-parallel GEMM) and two backward (f before each column-parallel GEMM).

Both are built from the dense modules of ``models.families.gpt`` (duck-typed: attention has ``qkv``,
``proj``, ``num_heads``, ``dropout``, ``resid_drop`` and ``causal``; the MLP has ``fc``, ``proj``,
``drop``), keeping their parameter names."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import CoreAttention
from models.tensor_parallel.context import TensorParallel, divide
from models.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from models.tensor_parallel.params import mark_replicated
from models.tensor_parallel.random import RNGTracker
from models.tensor_parallel.sequence import SequenceParallelLayerNorm


class ParallelSelfAttention(nn.Module):
    def __init__(self, qkv: ColumnParallelLinear, proj: RowParallelLinear, num_heads: int, dropout: float,
                 resid_drop: nn.Module, causal: bool, rng: RNGTracker, core: CoreAttention | None = None):
        super().__init__()
        tp = qkv.tp
        self.qkv, self.proj, self.resid_drop = qkv, proj, resid_drop
        self.local_heads = divide(num_heads, tp.size, "model.num_heads", "choose parallel.tp dividing the head count")
        self.head_dim = qkv.in_features // num_heads
        self.dropout, self.causal, self.rng = dropout, causal, rng
        # the dense layer's core keeps its context-parallel group: the ring runs on this rank's heads
        self.core = core if core is not None else CoreAttention(causal, dropout)

    @classmethod
    def from_dense(cls, attn: nn.Module, tp: TensorParallel, rng: RNGTracker) -> "ParallelSelfAttention":
        divide(attn.num_heads, tp.size, "model.num_heads", "choose parallel.tp dividing the head count")
        qkv = ColumnParallelLinear.from_dense(attn.qkv, tp, stride=3)
        proj = RowParallelLinear.from_dense(attn.proj, tp)
        return cls(qkv, proj, attn.num_heads, attn.dropout, attn.resid_drop, getattr(attn, "causal", True), rng,
                   getattr(attn, "core", None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)   # the whole sequence (with sequence parallelism x holds this rank's part)
        batch, seq, _ = qkv.shape
        shape = (batch, seq, self.local_heads, self.head_dim)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        y = self.core(q, k, v, rng=lambda: self.rng.fork(x.device))  # this rank's heads: its own dropout stream
        y = y.transpose(1, 2).reshape(batch, seq, self.local_heads * self.head_dim)
        return sequence_region_dropout(self.resid_drop, self.proj(y), self.rng, self.qkv.tp)


class ParallelMLP(nn.Module):
    def __init__(self, fc: ColumnParallelLinear, proj: RowParallelLinear, drop: nn.Module, rng: RNGTracker | None = None):
        super().__init__()
        self.fc, self.proj, self.drop, self.rng = fc, proj, drop, rng

    @classmethod
    def from_dense(cls, mlp: nn.Module, tp: TensorParallel, rng: RNGTracker | None = None) -> "ParallelMLP":
        return cls(ColumnParallelLinear.from_dense(mlp.fc, tp), RowParallelLinear.from_dense(mlp.proj, tp), mlp.drop, rng)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sequence_region_dropout(self.drop, self.proj(F.gelu(self.fc(x))), self.rng, self.fc.tp)


def sequence_region_dropout(dropout: nn.Module, x: torch.Tensor, rng: RNGTracker | None,
                            tp: TensorParallel) -> torch.Tensor:
    """Dropout after g. Replicated (no sequence parallelism): the global stream, the same mask on
    every rank. Sequence-parallel: each rank holds other positions, so its own stream."""
    if rng is None or not tp.sequence_parallel or x.is_meta or not dropout.training:
        return dropout(x)
    with rng.fork(x.device):
        return dropout(x)


def parallelize_block(block: nn.Module, tp: TensorParallel, rng: RNGTracker) -> nn.Module:
    """Swaps a dense block's ``attn`` and ``mlp`` for their tensor-parallel forms in place; the
    LayerNorms stay replicated (and are marked so)."""
    block.attn = ParallelSelfAttention.from_dense(block.attn, tp, rng)
    block.mlp = ParallelMLP.from_dense(block.mlp, tp, rng)
    if tp.sequence_parallel:   # the LayerNorms run on this rank's part of the sequence
        block.ln1 = SequenceParallelLayerNorm(block.ln1, tp)
        block.ln2 = SequenceParallelLayerNorm(block.ln2, tp)
    return mark_replicated(block)
