"""The conjugate f/g operators of Megatron (dissertation ch. 4.2.3) and split/gather along the last
dimension, as autograd functions over a ``TensorParallel`` group; plus the flat scatter/gather that
halves inter-stage traffic (ch. 4.4.1).

f (``copy_to_region``) is identity forward and all-reduce backward: it enters a sharded region
with a replicated input. g (``reduce_from_region``) is all-reduce forward and identity backward:
it leaves a sharded region with partial sums. With ``size == 1`` or on the meta device (shape
inference) nothing is communicated.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from models.tensor_parallel.context import TensorParallel


def _quiet(x: torch.Tensor, tp: TensorParallel) -> bool:
    return tp.size == 1 or x.is_meta


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sum over the group into a new tensor (the input may be saved by autograd elsewhere)."""
    if _quiet(x, tp):
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=tp.group)
    return out


def split_last(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    if tp.size == 1:
        return x
    if x.shape[-1] % tp.size:
        raise ValueError(f"last dimension {x.shape[-1]} does not split into {tp.size} tensor-parallel parts")
    return x.chunk(tp.size, dim=-1)[tp.rank].contiguous()


def gather_last(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    if tp.size == 1:
        return x
    if x.is_meta:
        return torch.cat([x] * tp.size, dim=-1)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad, ctx.tp), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        return all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return split_last(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return gather_last(grad, ctx.tp), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return gather_last(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return split_last(grad, ctx.tp), None


def copy_to_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient backward."""
    return x if tp.size == 1 else _CopyToRegion.apply(x, tp)


def reduce_from_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return x if tp.size == 1 else _ReduceFromRegion.apply(x, tp)


def scatter_to_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; the backward all-gathers the gradient."""
    return x if tp.size == 1 else _ScatterToRegion.apply(x, tp)


def gather_from_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """All-gather the last dimension (e.g. vocabulary-parallel logits for generation); the
    backward keeps this rank's slice of the gradient."""
    return x if tp.size == 1 else _GatherFromRegion.apply(x, tp)


def scatter_chunk(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Scatter/gather optimisation, send side: this rank's 1/t of a tensor that is replicated over
    the group (a stage output or input gradient), flattened. Needs ``numel % t == 0``."""
    if tp.size == 1:
        return x
    flat = x.reshape(-1)
    if flat.numel() % tp.size:
        raise ValueError(f"{flat.numel()} elements do not split into {tp.size} equal chunks; send the whole tensor")
    return flat.chunk(tp.size)[tp.rank].contiguous()


def gather_chunks(chunk: torch.Tensor, tp: TensorParallel, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Scatter/gather optimisation, receive side: all-gather the chunks into the full tensor."""
    if tp.size == 1:
        return chunk.reshape(shape)
    out = torch.empty(chunk.numel() * tp.size, dtype=chunk.dtype, device=chunk.device)
    if chunk.is_meta:
        return out.reshape(shape)
    dist.all_gather(list(out.chunk(tp.size)), chunk.contiguous(), group=tp.group)
    return out.reshape(shape)
