"""The attention core, softmax(QKᵀ/√d)·V with its dropout, as a module of its own: it is the part of
a transformer layer whose saved activations grow with the square of the sequence (the s x s scores,
softmax output and dropout mask: 5as/h of the 34 + 5as/h bytes per element of sbh that Korthikanti
et al. 2022 count for one layer) while costing few FLOPs. Selective recomputation
(``recompute.granularity=selective``) recomputes only these in the backward and keeps the rest.

Families build their attention with ``CoreAttention``; a plugin model that does the same gets
selective recomputation too. ``selectively_recompute`` switches it on in built layers. With a
context-parallel group (``models.context_parallel``) it attends through ``ring_attention`` instead."""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.context_parallel import ContextParallel, ring_attention
from models.group_context import splitting
from models.context_parallel.context import check_no_dropout


class CoreAttention(nn.Module):
    """Scaled dot-product attention of (batch, heads, seq, head_dim) queries, keys and values.
    Holds no parameters, so adding it changes no state dict. ``recompute`` (off by default) keeps
    only q, k and v for the backward and recomputes the rest there. ``cp`` (size > 1): q, k and v
    are this rank's zigzag shard of the sequence, attended against the whole one by ring attention."""

    def __init__(self, causal: bool = True, dropout: float = 0.0, cp: ContextParallel | None = None):
        super().__init__()
        self.causal = causal
        self.dropout = dropout
        self.recompute = False
        self.cp = splitting(cp)
        if self.cp is not None:
            check_no_dropout(dropout, self.cp)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rng: Callable[[], AbstractContextManager] | None = None) -> torch.Tensor:
        """``rng``: the dropout's random stream (a tensor-parallel rank's own); the recomputation
        replays it because the checkpoint, entered inside it, restores the state it started from."""
        dropout = self.dropout if self.training else 0.0
        with rng() if rng is not None and dropout > 0.0 and not q.is_meta else nullcontext():
            if self.recompute and torch.is_grad_enabled():
                return checkpoint(self._attend, q, k, v, dropout, use_reentrant=False)
            return self._attend(q, k, v, dropout)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> torch.Tensor:
        # dropout is 0 here (refused at construction); on the meta device (shape inference) the
        # plain attention below gives the ring's shape without communicating
        if self.cp is not None and not q.is_meta:
            return ring_attention(q, k, v, self.cp.group, causal=self.causal)
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=dropout,
                                              enable_gqa=k.shape[1] != q.shape[1])

    def extra_repr(self) -> str:
        split = "" if self.cp is None else f", cp={self.cp.size}"
        return f"causal={self.causal}, dropout={self.dropout}, recompute={self.recompute}{split}"


def selectively_recompute(modules: Iterable[nn.Module]) -> int:
    """Switches recomputation on in every ``CoreAttention`` inside ``modules``; returns how many."""
    cores = [m for module in modules for m in module.modules() if isinstance(m, CoreAttention)]
    for core in cores:
        core.recompute = True
    return len(cores)
