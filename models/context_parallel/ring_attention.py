"""Exact causal attention over a sequence split zigzag-wise (``layout``) across a context-parallel
group: the keys and values travel around the ring of ranks, one neighbour exchange per step.

Each rank keeps its queries. At ring step ``t`` it holds the keys/values of rank ``rank - t``,
computes that block's partial attention with the block's mask, and merges it into its running
output through the log-sum-exp of the scores. The next exchange starts before the block is
computed, so communication overlaps compute. The backward replays the ring, recomputing each
block from the saved log-sum-exp; the key/value gradient accumulators travel with the keys and
values and arrive home after the last step.

Under grouped-query attention only the ``kv_heads`` wide keys/values travel; they are repeated to
the query heads just for the local matmuls. The matmuls and softmax statistics run in (at least) float32
whatever the input dtype (bf16 included); outputs and gradients come back in the input dtype."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from models.errors import ConfigError


@dataclass
class PendingExchange:
    """A neighbour exchange in flight; ``wait`` returns the tensor received from the previous rank."""
    works: list
    received: torch.Tensor

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


class RingExchange:
    """Point-to-point with the ring neighbours of ``group``: sends to the next rank, receives from
    the previous one. Tests subclass it to watch what travels."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        grouped = group is not None or dist.is_initialized()
        self.size = dist.get_world_size(group) if grouped else 1
        self.rank = dist.get_rank(group) if grouped else 0

    def neighbour(self, offset: int) -> int:
        """The global rank ``offset`` places along the ring (point-to-point speaks global ranks)."""
        group = self.group if self.group is not None else dist.group.WORLD
        return dist.get_global_rank(group, (self.rank + offset) % self.size)

    def start(self, tensor: torch.Tensor) -> PendingExchange:
        received = torch.empty_like(tensor)
        # one batch, so NCCL cannot deadlock on two ranks that both send first
        ops = [dist.P2POp(dist.isend, tensor, self.neighbour(1), self.group),
               dist.P2POp(dist.irecv, received, self.neighbour(-1), self.group)]
        return PendingExchange(dist.batch_isend_irecv(ops), received)


@dataclass(frozen=True)
class Block:
    """Which local queries read which of the held keys, and whether the causal diagonal cuts it."""
    rows: slice
    cols: slice
    diagonal: bool


def block_of(source: int, rank: int, half: int, causal: bool) -> Block:
    """The visible part of the block of queries on ``rank`` against keys from ``source`` (zigzag:
    rank r holds chunks r and 2cp-1-r, front then back). Every block is partly visible; the
    quarters the causal mask hides whole are left out of the matmuls rather than masked."""
    everything = slice(None)
    if not causal:
        return Block(everything, everything, diagonal=False)
    if source == rank:   # own chunks: local order is global order, so the plain causal triangle
        return Block(everything, everything, diagonal=True)
    if source < rank:    # source's front chunk precedes both query chunks, its back chunk follows both
        return Block(everything, slice(None, half), diagonal=False)
    # source > rank: the front query chunk precedes both key chunks, the back one follows both
    return Block(slice(half, None), everything, diagonal=False)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for the matmuls and softmax statistics, or the input's own dtype if wider (float64)."""
    return torch.promote_types(dtype, torch.float32)


def repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Keys/values repeated to the query heads (head h reads kv head h // groups), upcast."""
    x = x.to(compute_dtype(x.dtype))
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def fold_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of ``repeat_heads``: the query heads' shares summed per kv head."""
    batch, heads, seq, dim = x.shape
    return x.view(batch, heads // groups, groups, seq, dim).sum(2) if groups > 1 else x


def block_scores(q: torch.Tensor, k: torch.Tensor, diagonal: bool, scale: float, groups: int) -> torch.Tensor:
    """QKᵀ/√d of one block (upcast), the future masked out on the diagonal block."""
    scores = q.to(compute_dtype(q.dtype)) @ repeat_heads(k, groups).transpose(-1, -2) * scale
    if diagonal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def attend_block(q, k, v, diagonal: bool, scale: float, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's own softmax attention (upcast) and the log-sum-exp of its scores per query."""
    scores = block_scores(q, k, diagonal, scale, groups)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ repeat_heads(v, groups), lse


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merges a block into the running output, in place (``out``, ``lse`` may be row views)."""
    # softmax over the union of keys: each part weighs exp(its lse - the union's lse), never overflowing
    total = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - total).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - total).unsqueeze(-1))
    lse.copy_(total)


def block_grads(q, k, v, grad_out, delta, lse, diagonal: bool, scale: float, groups: int):
    """dq, dk, dv (upcast, kv heads folded) of one block, its probabilities recomputed from ``lse``."""
    k_rep, v_rep = repeat_heads(k, groups), repeat_heads(v, groups)
    probs = torch.exp(block_scores(q, k, diagonal, scale, groups) - lse.unsqueeze(-1))
    grad_v = probs.transpose(-1, -2) @ grad_out
    # softmax backward: dS = P ∘ (dP - rowsum(dO ∘ O)), with dP = dO Vᵀ
    grad_scores = probs * (grad_out @ v_rep.transpose(-1, -2) - delta.unsqueeze(-1)) * scale
    grad_q = grad_scores @ k_rep
    grad_k = grad_scores.transpose(-1, -2) @ q.to(grad_scores.dtype)
    return grad_q, fold_heads(grad_k, groups), fold_heads(grad_v, groups)


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ConfigError(f"ring_attention takes q [batch, heads, seq, dim] and k, v [batch, kv_heads, seq, dim] "
                          f"of one shape; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    (batch, heads, seq, dim), (kv_batch, kv_heads, kv_seq, kv_dim) = q.shape, k.shape
    if (batch, seq, dim) != (kv_batch, kv_seq, kv_dim) or heads % kv_heads:
        raise ConfigError(f"ring_attention: q {tuple(q.shape)} does not fit k/v {tuple(k.shape)}: batch, seq and dim "
                          f"must match and kv_heads={kv_heads} must divide heads={heads}")
    if seq % 2:
        raise ConfigError(f"ring_attention: local sequence length {seq} is odd, but each context-parallel rank holds "
                          f"two equal zigzag chunks: make the global sequence a multiple of 2·cp (split_zigzag)")


def held_keys(kv: torch.Tensor, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
    """The visible columns of the stacked keys and values held at this ring step."""
    return kv[0][:, :, block.cols], kv[1][:, :, block.cols]


class RingAttention(torch.autograd.Function):
    """Forward and backward each walk the ring once: cp steps, cp-1 key/value exchanges."""

    @staticmethod
    def forward(ctx, q, k, v, exchange: RingExchange, causal: bool):
        # the matmuls run upcast as written: autocast (bf16/fp16 runs) would cast them back down
        with torch.autocast(q.device.type, enabled=False):
            return RingAttention._forward(ctx, q, k, v, exchange, causal)

    @staticmethod
    def _forward(ctx, q, k, v, exchange: RingExchange, causal: bool):
        check_shapes(q, k, v)
        groups, scale, half = q.shape[1] // k.shape[1], 1.0 / math.sqrt(q.shape[-1]), q.shape[2] // 2
        kv = torch.stack([k, v])   # one message per step, kv_heads wide
        out = lse = None
        for step in range(exchange.size):
            pending = exchange.start(kv) if step < exchange.size - 1 else None
            block = block_of((exchange.rank - step) % exchange.size, exchange.rank, half, causal)
            block_out, block_lse = attend_block(q[:, :, block.rows], *held_keys(kv, block), block.diagonal, scale,
                                                groups)
            if out is None:   # step 0 is the own block, whose rows cover every query
                out, lse = block_out, block_lse
            else:
                merge_block(out[:, :, block.rows], lse[:, :, block.rows], block_out, block_lse)
            if pending is not None:
                kv = pending.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.exchange, ctx.causal = exchange, causal
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):
            return RingAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        exchange = ctx.exchange
        groups, scale, half = q.shape[1] // k.shape[1], 1.0 / math.sqrt(q.shape[-1]), q.shape[2] // 2
        grad_out = grad_out.to(out.dtype)
        delta = (grad_out * out).sum(-1)
        grad_q = torch.zeros_like(q, dtype=out.dtype)
        kv, pending_grads = torch.stack([k, v]), None
        for step in range(exchange.size):
            pending_kv = exchange.start(kv) if step < exchange.size - 1 else None
            block = block_of((exchange.rank - step) % exchange.size, exchange.rank, half, ctx.causal)
            rows = (slice(None), slice(None), block.rows)
            dq, dk, dv = block_grads(q[rows], *held_keys(kv, block), grad_out[rows], delta[rows], lse[rows],
                                     block.diagonal, scale, groups)
            grad_q[rows] += dq
            grad_kv = torch.zeros(kv.shape, dtype=out.dtype, device=kv.device)
            grad_kv[0][:, :, block.cols], grad_kv[1][:, :, block.cols] = dk, dv
            if pending_grads is not None:   # the held keys' accumulator, from the ranks before
                grad_kv += pending_grads.wait()
            # pass it on with the keys: after the last step it reaches the rank owning them
            pending_grads = exchange.start(grad_kv) if exchange.size > 1 else None
            if pending_kv is not None:
                kv = pending_kv.wait()
        if pending_grads is not None:
            grad_kv = pending_grads.wait()
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None,
                   causal: bool = True, exchange: RingExchange | None = None) -> torch.Tensor:
    """softmax(QKᵀ/√d)·V of this rank's zigzag shard of the sequence against the whole sequence.

    q: [batch, heads, s_local, d]; k, v: [batch, kv_heads, s_local, d] (kv_heads divides heads), each
    rank's ``split_zigzag`` of the same global tensors. ``group``: the context-parallel group (a group
    of one, or no initialised process group with ``group=None``, is plain attention, no communication).
    ``exchange``: the neighbour transport, ``RingExchange(group)`` unless given."""
    return RingAttention.apply(q, k, v, exchange if exchange is not None else RingExchange(group), causal)
