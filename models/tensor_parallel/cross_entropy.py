"""Cross-entropy over logits whose vocabulary dimension is split across the tensor-parallel group,
without gathering them (Megatron): the row maximum is all-reduced (max), then the target logit and
the sum of exponentials (sum). Only ``t`` floats per token cross the group instead of ``V``."""
from __future__ import annotations

import torch
import torch.distributed as dist

from models.tensor_parallel.context import TensorParallel


def _all_reduce(x: torch.Tensor, tp: TensorParallel, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    if tp.size > 1 and not x.is_meta:
        dist.all_reduce(x, op=op, group=tp.group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss for logits [N, V_local] whose columns are vocabulary ids
    [vocab_start, vocab_start + V_local); columns at or past ``vocab_size`` are padding and ignored."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel, vocab_start: int,
                vocab_size: int, ignore_index: int) -> torch.Tensor:
        local_vocab = logits.shape[-1]
        real = max(0, min(local_vocab, vocab_size - vocab_start))  # columns that are not padding
        x = logits[:, :real].float()
        row_max = x.max(dim=-1).values if real else x.new_full((x.shape[0],), float("-inf"))
        _all_reduce(row_max, tp, dist.ReduceOp.MAX)
        x = x - row_max.unsqueeze(-1)
        local_target = targets - vocab_start
        mine = (local_target >= 0) & (local_target < real) & (targets != ignore_index)
        index = local_target.clamp(0, max(real - 1, 0)).unsqueeze(-1)
        picked = x.gather(-1, index).squeeze(-1) * mine if real else x.new_zeros(x.shape[0])
        exp = x.exp_()
        sum_exp = exp.sum(dim=-1)
        _all_reduce(picked, tp)
        _all_reduce(sum_exp, tp)
        valid = targets != ignore_index
        loss = (sum_exp.log() - picked) * valid
        exp.div_(sum_exp.unsqueeze(-1))  # now the local part of the softmax
        ctx.save_for_backward(exp, index, mine, valid)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, index, mine, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, index, -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        if grad.shape != ctx.shape:  # padding columns get zero gradient
            grad = torch.cat([grad, grad.new_zeros(ctx.shape[0], ctx.shape[1] - grad.shape[1])], dim=-1)
        return grad.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel,
                                 vocab_size: int, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy over non-ignored targets, as ``F.cross_entropy(gathered_logits[..., :vocab_size],
    targets, ignore_index=ignore_index)``. ``logits[..., V/t]`` is this rank's vocabulary slice
    (rank r holds ids [r*V/t, (r+1)*V/t) of the vocabulary padded to a multiple of t)."""
    local_vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, local_vocab)
    flat_targets = targets.reshape(-1)
    per_token = _VocabParallelCrossEntropy.apply(flat_logits, flat_targets, tp, tp.rank * local_vocab,
                                                 vocab_size, ignore_index)
    count = (flat_targets != ignore_index).sum()
    return per_token.sum() / count
