"""Sequence parallelism (Korthikanti et al. 2022): between the tensor-parallel GEMMs, a transformer
layer's LayerNorms, dropouts and residual additions run on 1/t of the sequence on each rank instead
of the whole sequence replicated t times. The all-reduce g after a row-parallel GEMM becomes a
reduce-scatter along the sequence, and the identity f before a column-parallel GEMM an all-gather
along it: the same bytes on the wire, and the activations in those regions shrink t-fold.

Tensors are (batch, seq, ...): the sequence is dimension 1. Parameters used in a sequence-sharded
region (LayerNorm weights, a row-parallel GEMM's bias, learned positions) see only this rank's part
of the sequence, so their gradients are partial sums: ``sequence_parallel_weight`` routes them
through f, whose backward all-reduces them over the group.

On the meta device (shape inference) nothing is communicated and the shapes are what they would be.
Gloo has no reduce-scatter: there it is an all-reduce followed by keeping this rank's part.
(The flat collectives come from ``flat_collectives``, which finds them under either torch's name.)
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from models.tensor_parallel.context import TensorParallel
from models.tensor_parallel.flat_collectives import all_gather_flat, reduce_scatter_flat
from models.tensor_parallel.mappings import copy_to_region

SEQUENCE_DIM = 1


def _split(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    if x.shape[SEQUENCE_DIM] % tp.size:
        raise ValueError(f"sequence length {x.shape[SEQUENCE_DIM]} does not split into {tp.size} "
                         f"sequence-parallel parts")
    return x.chunk(tp.size, dim=SEQUENCE_DIM)[tp.rank].contiguous()


def all_gather_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    if x.is_meta:
        return torch.cat([x] * tp.size, dim=SEQUENCE_DIM)
    seq_first = x.transpose(0, SEQUENCE_DIM).contiguous()
    out = torch.empty((seq_first.shape[0] * tp.size, *seq_first.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(out, seq_first, group=tp.group)
    return out.transpose(0, SEQUENCE_DIM)


def reduce_scatter_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    if x.is_meta:
        return _split(x, tp)
    if dist.get_backend(tp.group) == "gloo":
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=tp.group)
        return _split(out, tp)
    seq_first = x.transpose(0, SEQUENCE_DIM).contiguous()
    out = torch.empty((seq_first.shape[0] // tp.size, *seq_first.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out, seq_first, group=tp.group)
    return out.transpose(0, SEQUENCE_DIM)


class _GatherSequence(torch.autograd.Function):
    """Enters a column-parallel GEMM: all-gather forward; the input gradients are partial sums, so
    the backward reduce-scatters them back to this rank's part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return all_gather_sequence(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_sequence(grad, ctx.tp), None


class _ReduceScatterSequence(torch.autograd.Function):
    """Leaves a row-parallel GEMM: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return reduce_scatter_sequence(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_sequence(grad, ctx.tp), None


def gather_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The whole sequence from each rank's part (replaces f before a column-parallel GEMM)."""
    return x if tp.size == 1 else _GatherSequence.apply(x, tp)


def scatter_sequence_sum(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's part of the sequence of the sum over ranks (replaces g after a row-parallel GEMM)."""
    return x if tp.size == 1 else _ReduceScatterSequence.apply(x, tp)


def sequence_parallel_weight(param: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """A replicated parameter used on this rank's part of the sequence: its gradient is summed over
    the group in the backward, so every rank steps it with the whole sequence's gradient."""
    return copy_to_region(param, tp)


def sequence_range(seq_len: int, tp: TensorParallel) -> tuple[int, int]:
    """[start, end) of this rank's part of a sequence of ``seq_len``."""
    part = seq_len // tp.size
    return tp.rank * part, (tp.rank + 1) * part


class SequenceParallelLayerNorm(nn.Module):
    """``nn.LayerNorm`` on this rank's part of the sequence; keeps the wrapped module's parameters
    (and so their names)."""

    def __init__(self, norm: nn.LayerNorm, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.normalized_shape, self.eps = norm.normalized_shape, norm.eps
        self.weight, self.bias = norm.weight, norm.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else sequence_parallel_weight(self.bias, self.tp)
        return nn.functional.layer_norm(x, self.normalized_shape, sequence_parallel_weight(self.weight, self.tp),
                                        bias, self.eps)
