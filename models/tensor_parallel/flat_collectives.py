"""All-gather and reduce-scatter of flat tensors under the name the installed torch gives them:
``all_gather_single``/``reduce_scatter_single`` in torch 2.13, ``all_gather_into_tensor``/
``reduce_scatter_tensor`` before (the CUDA machines' torch 2.11, for one)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_flat(out: torch.Tensor, mine: torch.Tensor, group=None, async_op: bool = False):
    """``out`` (group size x ``mine``) receives every rank's ``mine`` in rank order."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, mine, group=group, async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, full: torch.Tensor, group=None, async_op: bool = False):
    """``out`` receives this rank's part (rank order) of ``full`` summed over the group."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(out, full, group=group, async_op=async_op)
