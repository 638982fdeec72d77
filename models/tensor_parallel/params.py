"""Per-parameter tensor-parallel metadata, and slicing/gathering between dense and sharded tensors.

Every parameter of a tensor-parallel layer carries ``tensor_parallel_sharded`` (bool). Sharded ones
also carry ``tensor_parallel_spec`` (a ``ShardSpec``) saying how the dense tensor was cut, so the
runtime can count replicated parameters once in a gradient norm, and tests and exporters can
reassemble the dense tensor. Parameters without the attribute are replicated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models.tensor_parallel.context import TensorParallel


@dataclass(frozen=True)
class ShardSpec:
    """How a dense tensor is split over ``t`` ranks along ``dim``.

    The dense tensor is first viewed as ``stride`` equal blocks along ``dim`` (e.g. 3 for a fused
    [q; k; v] projection) and rank r keeps part r of every block. ``full_size`` is the dense length
    along ``dim`` before zero padding to a multiple of ``stride * t`` (the vocabulary)."""

    dim: int
    full_size: int
    stride: int = 1


def shard_tensor(dense: torch.Tensor, spec: ShardSpec, tp: TensorParallel) -> torch.Tensor:
    """This rank's shard of ``dense`` (padding with zeros where ``full_size`` needs it)."""
    if dense.shape[spec.dim] != spec.full_size:
        raise ValueError(f"dense size {dense.shape[spec.dim]} along dim {spec.dim} != spec {spec.full_size}")
    multiple = spec.stride * tp.size
    missing = -spec.full_size % multiple
    if missing:
        if spec.stride != 1:
            raise ValueError("padding a strided shard is not supported")
        pad = [0, 0] * (dense.dim() - 1 - spec.dim % dense.dim()) + [0, missing]
        dense = F.pad(dense, pad)
    blocks = dense.chunk(spec.stride, dim=spec.dim)
    return torch.cat([block.chunk(tp.size, dim=spec.dim)[tp.rank] for block in blocks], dim=spec.dim).clone()


def gather_shards(shards: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The dense tensor from every rank's shard (in rank order), padding cut off."""
    per_rank = [shard.chunk(spec.stride, dim=spec.dim) for shard in shards]
    blocks = [torch.cat([parts[b] for parts in per_rank], dim=spec.dim) for b in range(spec.stride)]
    return torch.cat(blocks, dim=spec.dim).narrow(spec.dim, 0, spec.full_size)


def gather_tensor(shard: torch.Tensor, spec: ShardSpec, tp: TensorParallel) -> torch.Tensor:
    """All-gathers a shard (a weight or its gradient) into the dense tensor on every rank."""
    if tp.size == 1:
        return gather_shards([shard], spec)
    parts = [torch.empty_like(shard) for _ in range(tp.size)]
    dist.all_gather(parts, shard.contiguous(), group=tp.group)
    return gather_shards(parts, spec)


def mark_sharded(param: nn.Parameter, spec: ShardSpec) -> nn.Parameter:
    param.tensor_parallel_sharded = True
    param.tensor_parallel_spec = spec
    return param


def mark_replicated(module: nn.Module) -> nn.Module:
    """Marks every parameter not already marked sharded as replicated over the group."""
    for param in module.parameters():
        if not getattr(param, "tensor_parallel_sharded", False):
            param.tensor_parallel_sharded = False
            param.tensor_parallel_spec = None
    return module


def is_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_parallel_sharded", False))


def shard_spec(param: torch.Tensor) -> ShardSpec | None:
    return getattr(param, "tensor_parallel_spec", None)


def grad_norm_squared(params: Iterable[nn.Parameter], tp: TensorParallel) -> torch.Tensor:
    """Squared L2 norm of the gradients of one stage's tensor-parallel group, the same on every
    rank of the group: sharded gradients summed over the group, replicated ones counted once."""
    grads = [(param.grad, is_sharded(param)) for param in params if param.grad is not None]
    device = grads[0][0].device if grads else torch.device("cpu")
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    for grad, param_is_sharded in grads:
        value = grad.detach().double().pow(2).sum()
        if param_is_sharded:
            sharded += value
        else:
            replicated += value
    if tp.size > 1:
        dist.all_reduce(sharded, group=tp.group)
    return sharded + replicated
