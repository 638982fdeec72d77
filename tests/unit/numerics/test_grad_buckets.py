"""Bucketed data-parallel gradient reduction: which parameters share a bucket, and that a bucket
leaves only once the step's last micro-batch has produced all its gradients (autograd's and the
fused Linears' alike), with a stand-in all-reduce that records what it was given."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from models.grad_accumulation import WeightGradQueue, fuse_grad_accumulation
from pipedream.errors import InvariantError
from pipedream.numerics import grad_buckets
from pipedream.numerics.grad_buckets import BucketedReduction, assign_buckets


class _Done:
    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Reductions:
    """Stands in for ``dist.all_reduce`` with two replicas holding the same gradients."""

    def __init__(self):
        self.launches: list[tuple[int, torch.Tensor]] = []   # (backwards run so far, buffer sent)
        self.backwards = 0

    def __call__(self, tensor: torch.Tensor, group=None, async_op: bool = False) -> _Done:
        assert async_op
        self.launches.append((self.backwards, tensor.clone()))
        tensor.mul_(2)
        return _Done()


class _Recorder:
    def __init__(self):
        self.spans: list[tuple[int, float, float]] = []

    def record_reduction(self, bucket: int, start: float, end: float) -> None:
        self.spans.append((bucket, start, end))


def _position(params: list[nn.Parameter], param: nn.Parameter) -> int:
    return next(i for i, p in enumerate(params) if p is param)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def test_buckets_follow_reverse_order_of_use_and_split_by_size_and_dtype() -> None:
    params = [nn.Parameter(torch.zeros(n, dtype=d)) for n, d in
              [(4, torch.float32), (4, torch.float32), (2, torch.float32), (8, torch.bfloat16), (3, torch.float32)]]
    buckets = assign_buckets(params, bucket_bytes=24)   # 6 fp32 values
    order = [[_position(params, p) for p in b.params] for b in buckets]
    assert order == [[4], [3], [2, 1], [0]]
    assert buckets[2].offsets == [0, 2] and buckets[2].numel == 6
    assert [b.dtype for b in buckets] == [torch.float32, torch.bfloat16, torch.float32, torch.float32]


@pytest.mark.parametrize("fused", [False, True], ids=["autograd", "fused-linear"])
def test_a_bucket_leaves_after_the_last_microbatch_only(monkeypatch, fused: bool) -> None:
    model, queue = _model(), WeightGradQueue()
    params = list(model.parameters())
    reductions, recorder = _Reductions(), _Recorder()
    monkeypatch.setattr(grad_buckets.dist, "all_reduce", reductions)
    reduction = BucketedReduction(params, None, dp=2, bucket_bytes=18 * 4, overlap=True, recorder=recorder)
    if fused:
        fuse_grad_accumulation(model, queue)
        queue.after_accumulate = reduction.accumulated
    assert [len(b.params) for b in reduction.buckets] == [2, 2, 2]   # one Linear (bias, weight) each
    inputs = torch.randn(3, 5, 4)
    for step in range(2):
        for param in params:
            param.grad = None
        reductions.launches.clear()
        reductions.backwards = 0
        for microbatch in range(3):
            model(inputs[microbatch]).square().mean().backward()
            reductions.backwards += 1
        expected = [p.grad.clone() for p in params]
        reduction.finish()
        # the first step counts the accumulations and launches at the end; later ones at the last
        # micro-batch's backward, i.e. before the third backward has returned
        assert [when for when, _ in reductions.launches] == [3, 3, 3] if step == 0 else [2, 2, 2]
        sent = torch.cat([t for _, t in reductions.launches])
        by_bucket = torch.cat([torch.cat([expected[_position(params, p)].reshape(-1) for p in b.params])
                               for b in reduction.buckets])
        torch.testing.assert_close(sent, by_bucket, rtol=0, atol=0)    # complete sums, nothing partial
        for param, grad in zip(params, expected):
            torch.testing.assert_close(param.grad, grad, rtol=0, atol=0)   # (2 replicas' sum) / 2
    assert [bucket for bucket, _, _ in recorder.spans] == [0, 1, 2] * 2


def test_weight_gradients_of_a_split_backward_wait_for_their_w(monkeypatch) -> None:
    model, queue = _model(), WeightGradQueue()
    fuse_grad_accumulation(model, queue)
    params = list(model.parameters())
    reductions = _Reductions()
    monkeypatch.setattr(grad_buckets.dist, "all_reduce", reductions)
    reduction = BucketedReduction(params, None, dp=2, bucket_bytes=1 << 20, overlap=True)   # one bucket
    queue.after_accumulate = reduction.accumulated
    inputs = torch.randn(2, 5, 4)
    for step in range(2):
        for param in params:
            param.grad = None
        reductions.launches.clear()
        for microbatch in range(2):
            with queue.deferred(microbatch):   # B: input gradients (and biases) only
                model(inputs[microbatch]).square().mean().backward()
        assert not reductions.launches
        queue.run(0)
        assert not reductions.launches
        queue.run(1)                           # the last W completes the bucket
        assert len(reductions.launches) == (0 if step == 0 else 1)
        reduction.finish()
        assert len(reductions.launches) == 1


def test_more_accumulations_than_counted_stop_the_run(monkeypatch) -> None:
    model = _model()
    params = list(model.parameters())
    monkeypatch.setattr(grad_buckets.dist, "all_reduce", _Reductions())
    reduction = BucketedReduction(params, None, dp=2, bucket_bytes=1 << 20, overlap=True)
    inputs = torch.randn(3, 5, 4)
    model(inputs[0]).sum().backward()
    reduction.finish()
    for microbatch in range(2):
        model(inputs[microbatch]).sum().backward()
    with pytest.raises(InvariantError, match="overlap_grad_reduce=false"):
        reduction.finish()


def test_a_gradient_no_hook_reported_keeps_its_bucket_for_the_sync(monkeypatch) -> None:
    model = _model()
    extra = nn.Parameter(torch.zeros(18))   # its gradient arrives behind autograd's back
    params = list(model.parameters()) + [extra]
    reductions = _Reductions()
    monkeypatch.setattr(grad_buckets.dist, "all_reduce", reductions)
    reduction = BucketedReduction(params, None, dp=2, bucket_bytes=18 * 4, overlap=True)
    assert reduction.buckets[0].params == [extra]
    inputs = torch.randn(2, 5, 4)
    for step in range(2):
        for param in params:
            param.grad = None
        reductions.launches.clear()
        reductions.backwards = 0
        for microbatch in range(2):
            model(inputs[microbatch]).square().mean().backward()
            extra.grad = torch.ones(18) if extra.grad is None else extra.grad + 1
            reductions.backwards += 1
        reduction.finish()
        assert [when for when, _ in reductions.launches] == [2] * 4   # all at the sync, in order
        torch.testing.assert_close(reductions.launches[0][1], torch.full((18,), 2.0))
