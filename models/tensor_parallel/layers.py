"""Column- and row-parallel linear layers and the vocabulary-parallel embedding.

Each holds only its shard. ``from_dense`` slices an existing dense module, which is how the models
start from exactly the single-process weights; a model too large for one device would instead
build these directly and initialise each shard under ``RNGTracker.fork`` (a sharded RNG).
Parameter names (``weight``, ``bias``) match ``nn.Linear``/``nn.Embedding`` so state dicts line up.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models.grad_accumulation import WeightGradQueue, accumulate_weight_grad, accumulating_linear
from models.tensor_parallel.context import TensorParallel, divide, padded_size
from models.tensor_parallel.mappings import copy_to_region, gather_from_region, reduce_from_region, scatter_to_region
from models.tensor_parallel.params import ShardSpec, mark_replicated, mark_sharded, shard_tensor
from models.tensor_parallel.sequence import gather_sequence, scatter_sequence_sum, sequence_parallel_weight

INIT_STD = 0.02


def _sharded_parameter(shape: tuple[int, ...], spec: ShardSpec) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape))
    nn.init.normal_(param, std=INIT_STD)
    return mark_sharded(param, spec)


class _ColumnParallelLinearFn(torch.autograd.Function):
    """f followed by the GEMM as one function, so the backward can start the all-reduce of the
    input gradient and compute the weight gradient while it runs (Megatron's async all-reduce).
    With ``fused`` the weight gradient accumulates inside its GEMM into ``weight.grad`` (never
    held back: it is what hides the all-reduce)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallel,
                fused: bool):
        ctx.save_for_backward(x, weight)
        ctx.tp, ctx.has_bias = tp, bias is not None
        ctx.leaf = weight if fused else None   # the weight itself: its .grad is where the sum goes
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_input, pending = None, None
        if ctx.needs_input_grad[0]:  # under autocast the GEMMs ran in grad's dtype
            grad_input = grad.matmul(weight.to(grad.dtype)).to(x.dtype)
            if ctx.tp.size > 1 and not grad_input.is_meta:
                pending = dist.all_reduce(grad_input, group=ctx.tp.group, async_op=True)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1] and ctx.leaf is not None:
            accumulate_weight_grad(ctx.leaf, grad, x)
        elif ctx.needs_input_grad[1]:
            grad_weight = flat_grad.t().matmul(x.reshape(-1, x.shape[-1]).to(grad.dtype)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat_grad.sum(0).to(weight.dtype)
        if pending is not None:
            pending.wait()
        return grad_input, grad_weight, grad_bias, None, None


class ColumnParallelLinear(nn.Module):
    """Y_r = X A_r: the output features are split; the input enters through f (identity forward,
    all-reduce of its gradient backward). ``stride`` keeps fused projections ([q; k; v]) split per
    block, so every rank holds whole heads of q, k and v. ``fused_weight_grads`` (set by
    ``fuse_grad_accumulation``) accumulates the weight gradient inside its GEMM; with tp = 1 it
    goes through ``weight_grads`` like an ``nn.Linear``'s."""

    fused_weight_grads = False
    weight_grads: WeightGradQueue | None = None

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, bias: bool = True,
                 stride: int = 1, gather_output: bool = False):
        super().__init__()
        self.tp, self.gather_output, self.stride = tp, gather_output, stride
        self.in_features, self.out_features = in_features, out_features
        local = divide(out_features, tp.size * stride, "out_features",
                       "choose sizes that the tensor-parallel degree divides")
        spec = ShardSpec(dim=0, full_size=out_features, stride=stride)
        self.weight = _sharded_parameter((local * stride, in_features), spec)
        self.bias = mark_sharded(nn.Parameter(torch.zeros(local * stride)), spec) if bias else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, tp: TensorParallel, stride: int = 1,
                   gather_output: bool = False) -> "ColumnParallelLinear":
        layer = cls(linear.in_features, linear.out_features, tp, linear.bias is not None, stride, gather_output)
        with torch.no_grad():
            layer.weight.copy_(shard_tensor(linear.weight, layer.weight.tensor_parallel_spec, tp))
            if linear.bias is not None:
                layer.bias.copy_(shard_tensor(linear.bias, layer.bias.tensor_parallel_spec, tp))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1 or self.tp.sequence_parallel:
            if self.tp.sequence_parallel:   # the whole sequence from every rank's part (replaces f)
                x = gather_sequence(x, self.tp)
            y = (accumulating_linear(x, self.weight, self.bias, self.weight_grads) if self.fused_weight_grads
                 else F.linear(x, self.weight, self.bias))
        else:  # = F.linear(copy_to_region(x, tp), weight, bias), overlapping f's all-reduce
            fused = self.fused_weight_grads and self.weight.is_leaf and self.weight.requires_grad
            y = _ColumnParallelLinearFn.apply(x, self.weight, self.bias, self.tp, fused)
        if not self.gather_output:
            return y
        y = gather_from_region(y, self.tp)  # [rank][block][part]; the dense order is [block][rank][part]
        if self.stride > 1:
            y = y.unflatten(-1, (self.tp.size, self.stride, -1)).transpose(-3, -2).flatten(-3)
        return y


class RowParallelLinear(nn.Module):
    """Z = sum_r Y_r B_r: the input features are split; partial products leave through g (all-reduce
    forward, identity backward) and the replicated bias is added once, after the reduction.
    ``fused_weight_grads``: as ``nn.Linear`` under ``fuse_grad_accumulation`` (through
    ``weight_grads``, so a pipeline stage may hold the GEMM back until after its send)."""

    fused_weight_grads = False
    weight_grads: WeightGradQueue | None = None

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, bias: bool = True,
                 input_is_parallel: bool = True):
        super().__init__()
        self.tp, self.input_is_parallel = tp, input_is_parallel
        self.in_features, self.out_features = in_features, out_features
        local = divide(in_features, tp.size, "in_features", "choose sizes that the tensor-parallel degree divides")
        self.weight = _sharded_parameter((out_features, local), ShardSpec(dim=1, full_size=in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        mark_replicated(self)

    @classmethod
    def from_dense(cls, linear: nn.Linear, tp: TensorParallel, input_is_parallel: bool = True) -> "RowParallelLinear":
        layer = cls(linear.in_features, linear.out_features, tp, linear.bias is not None, input_is_parallel)
        with torch.no_grad():
            layer.weight.copy_(shard_tensor(linear.weight, layer.weight.tensor_parallel_spec, tp))
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.tp)
        partial = (accumulating_linear(x, self.weight, None, self.weight_grads) if self.fused_weight_grads
                   else F.linear(x, self.weight))
        if self.tp.sequence_parallel:   # this rank's part of the sequence of the sum (replaces g)
            y = scatter_sequence_sum(partial, self.tp)
            return y if self.bias is None else y + sequence_parallel_weight(self.bias, self.tp)
        y = reduce_from_region(partial, self.tp)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous range of the (padded) vocabulary; tokens outside it look up
    zeros and the partial embeddings are summed by g. Padding rows are zero and never looked up."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.per_rank = padded_size(num_embeddings, tp.size) // tp.size
        self.vocab_start = tp.rank * self.per_rank
        self.weight = _sharded_parameter((self.per_rank, embedding_dim), ShardSpec(dim=0, full_size=num_embeddings))
        with torch.no_grad():  # rows past the real vocabulary (padding) stay zero
            self.weight[max(0, num_embeddings - self.vocab_start):].zero_()

    @classmethod
    def from_dense_weight(cls, weight: torch.Tensor, tp: TensorParallel) -> "VocabParallelEmbedding":
        layer = cls(weight.shape[0], weight.shape[1], tp)
        with torch.no_grad():
            layer.weight.copy_(shard_tensor(weight, layer.weight.tensor_parallel_spec, tp))
        return layer

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(tokens, self.weight)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return scatter_sequence_sum(out, self.tp) if self.tp.sequence_parallel else reduce_from_region(out, self.tp)


def vocab_parallel_logits(x: torch.Tensor, weight: torch.Tensor, tp: TensorParallel,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's slice of the vocabulary logits from a replicated hidden state (f, then the
    shard of the output embedding); feed them to ``vocab_parallel_cross_entropy`` ungathered."""
    if tp.sequence_parallel:   # the whole sequence from every rank's part; its backward sums the parts
        return F.linear(gather_sequence(x, tp), weight, bias)
    return F.linear(copy_to_region(x, tp), weight, bias)
