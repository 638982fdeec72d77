"""Linear layers that accumulate their weight gradient inside the GEMM give autograd's gradients,
under every way the runtime calls them: saved-tensor hooks (stash accounting), recomputation,
weight versions (functional_call), and weight gradients held back to run later."""
from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from models.grad_accumulation import AccumulatingLinear, WeightGradQueue, accumulating_linear, fuse_grad_accumulation


def pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    reference = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 5, bias=False))
    fused = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 5, bias=False))
    fused.load_state_dict(reference.state_dict())
    return reference, fused


def batches(n: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(2, 4, 6, generator=generator) for _ in range(n)]


def assert_same_grads(reference: nn.Module, fused: nn.Module) -> None:
    for (name, a), (_, b) in zip(reference.named_parameters(), fused.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-6, msg=name)


def test_swaps_only_plain_linears_and_keeps_the_state_dict() -> None:
    reference, fused = pair()
    assert fuse_grad_accumulation(fused) == 2
    assert all(type(m) is AccumulatingLinear for m in fused if isinstance(m, nn.Linear))
    assert fused.state_dict().keys() == reference.state_dict().keys()
    x = batches(1)[0]
    torch.testing.assert_close(fused(x), reference(x))


def test_accumulates_over_micro_batches_like_autograd() -> None:
    reference, fused = pair()
    fuse_grad_accumulation(fused)
    for x in batches():
        reference(x).pow(2).mean().backward()
        inputs = x.clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):   # as Stage counts stash bytes
            out = fused(inputs)
        out.pow(2).mean().backward()
    assert_same_grads(reference, fused)


def test_recomputation_and_weight_versions() -> None:
    reference, fused = pair()
    fuse_grad_accumulation(fused)
    version = {name: p.detach().clone().requires_grad_(True) for name, p in fused.named_parameters()}
    for x in batches():
        reference(x).sum().backward()
        checkpoint(lambda t: functional_call(fused, version, (t,)), x, use_reentrant=False).sum().backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(version[name].grad, p.grad, rtol=1e-6, atol=1e-6)
        assert dict(fused.named_parameters())[name].grad is None   # the version, not the parameter, got it


def test_deferred_weight_gradients_wait_until_run() -> None:
    reference, fused = pair()
    queue = WeightGradQueue()
    fuse_grad_accumulation(fused, queue)
    for step, x in enumerate(batches()):
        reference(x).sum().backward()
        inputs = x.clone().requires_grad_(True)
        with queue.deferred(step):
            fused(inputs).sum().backward()
        assert inputs.grad is not None          # the input gradient is there at once
        assert fused[0].bias.grad is not None   # biases go through autograd as usual
        assert len(queue) == 1
        assert queue.run_oldest() == step
        assert len(queue) == 0
    assert_same_grads(reference, fused)


def test_held_groups_run_oldest_first_and_sum_in_order() -> None:
    """Groups held across later backwards (the executor's weight_grads_delay) give the very same
    gradients, bit for bit, as running each group at once: the sum's order is unchanged."""
    _, at_once = pair()
    _, held = pair()
    held.load_state_dict(at_once.state_dict())
    queue_now, queue_held = WeightGradQueue(), WeightGradQueue()
    fuse_grad_accumulation(at_once, queue_now)
    fuse_grad_accumulation(held, queue_held)
    ran = []
    for step, x in enumerate(batches(5)):
        with queue_now.deferred(step):
            at_once(x).sum().backward()
        queue_now.run_oldest()
        with queue_held.deferred(step):
            held(x).sum().backward()
        if len(queue_held) > 2:
            ran.append(queue_held.run_oldest())
    while len(queue_held):
        ran.append(queue_held.run_oldest())
    assert ran == list(range(len(ran)))
    for (name, a), b in zip(at_once.named_parameters(), held.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_no_grad_and_frozen_weights_take_the_plain_path() -> None:
    _, fused = pair()
    fuse_grad_accumulation(fused)
    fused[0].weight.requires_grad_(False)
    fused(batches(1)[0]).sum().backward()
    assert fused[0].weight.grad is None and fused[2].weight.grad is not None
    with torch.no_grad():
        assert fused(batches(1)[0]).grad_fn is None


def test_held_gemms_run_later_leave_no_graph_on_the_gradient():
    """A held weight-gradient GEMM runs outside the backward, where grad mode is on: recorded, it
    would give .grad a graph that keeps every micro-batch's inputs alive until the step ends."""
    queue = WeightGradQueue()
    weight = torch.nn.Parameter(torch.randn(3, 4))
    for key in ("a", "b"):
        inputs = torch.randn(2, 4, requires_grad=True)
        with queue.deferred(key):
            accumulating_linear(inputs, weight, None, queue).sum().backward()
    queue.run("b")
    queue.run_oldest()
    assert weight.grad is not None and not weight.grad.requires_grad and weight.grad.grad_fn is None
