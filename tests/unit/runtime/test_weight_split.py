"""The split backward for any layers (``pipedream/runtime/weight_split.py``): the input half gives
the input gradient and leaves the split parameters untouched, the weight half then gives every
parameter the single backward's gradient, bit for bit; graphs it cannot split are refused."""
from __future__ import annotations

import torch
from torch import nn

from models.grad_accumulation import WeightGradQueue, fuse_grad_accumulation
from pipedream.runtime.weight_split import input_half, parameter_nodes


def _blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True) for _ in range(2)))


def test_stock_blocks_split_into_input_and_weight_halves_exactly() -> None:
    reference, split = _blocks(), _blocks()
    queue = WeightGradQueue()
    fuse_grad_accumulation(split, queue)   # the feed-forward Linears hold their GEMMs in the queue
    fused = {id(p) for m in split.modules() if getattr(m, "fused_weight_grads", False) for p in m.parameters()}
    others = [p for p in split.parameters() if id(p) not in fused]
    for microbatch in range(2):
        x, grad = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
        x_ref, x_split = x.clone().requires_grad_(), x.clone().requires_grad_()
        reference(x_ref).backward(grad)
        before = [None if p.grad is None else p.grad.clone() for p in others]
        with queue.deferred(microbatch):
            half = input_half([split(x_split)], [grad], [x_split], parameter_nodes(others),
                              parameter_nodes(p for p in split.parameters() if id(p) in fused))
        assert half is not None and len(half.groups) >= 4   # attention projections and LayerNorms per block
        assert torch.equal(x_split.grad, x_ref.grad)
        assert all((b is None and p.grad is None) or torch.equal(b, p.grad) for b, p in zip(before, others))
        queue.run(microbatch)
        half.run()
    for (name, p_ref), p_split in zip(reference.named_parameters(), split.parameters()):
        assert torch.equal(p_ref.grad, p_split.grad), name


def test_a_parameter_on_two_branches_or_an_output_without_the_input_is_refused() -> None:
    weight = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    twice = (x @ weight) @ weight
    assert input_half([twice], [torch.ones(2, 4)], [x], parameter_nodes([weight]), {}) is None
    assert x.grad is None and weight.grad is None   # nothing ran
    alone = weight * 2.0
    assert input_half([alone, x * 2.0], [torch.ones(4, 4), torch.ones(2, 4)], [x],
                      parameter_nodes([weight]), {}) is None


class _SquaredWeight(nn.Module):
    """One weight matrix used twice on the input's path: a graph the split refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight) @ self.weight


def _stage_backward(chunk: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    from pipedream.runtime.stage import Stage

    stage = Stage([chunk], is_first=[False], is_last=[False], loss_fn=lambda out, target: out.sum())
    stage.forward(0, 0, x)
    input_grad = stage.backward(0, 0, grad, split=True)
    held = {name: p.grad is None for name, p in chunk.named_parameters()}
    stage.weight_grad(0, 0)
    return stage, input_grad, held


def test_the_stage_splits_a_stock_chunk_and_runs_a_refused_graph_whole_in_b() -> None:
    reference, chunk = _blocks(), _blocks()
    x, grad = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    x_ref = x.clone().requires_grad_()
    reference(x_ref).backward(grad)
    stage, input_grad, held = _stage_backward(chunk, x, grad)
    assert torch.equal(input_grad, x_ref.grad) and stage._split_params[0] is not None
    assert held["0.self_attn.in_proj_weight"]   # left to W
    for (name, p_ref), p in zip(reference.named_parameters(), chunk.parameters()):
        assert torch.equal(p_ref.grad, p.grad), name
    torch.manual_seed(1)
    twice = _SquaredWeight()
    x = torch.randn(3, 4)
    x_ref = x.clone().requires_grad_()
    twice(x_ref).backward(torch.ones(3, 4))
    expected = twice.weight.grad.clone()
    twice.weight.grad = None
    stage, input_grad, held = _stage_backward(twice, x, torch.ones(3, 4))
    assert stage._split_params[0] is None and not held["weight"]   # computed in B, not split again
    assert torch.equal(input_grad, x_ref.grad) and torch.equal(twice.weight.grad, expected)
