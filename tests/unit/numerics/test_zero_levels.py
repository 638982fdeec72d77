"""ZeRO-2 and ZeRO-3 in a Gloo world of one (dp = 1: the collectives are identities), against plain
AdamW: zero2 holds no gradient between steps; zero3 frees every parameter's storage between steps,
gathers each bucket once per step however many micro-batches run (its layers' forward pre-hooks),
or, fully sharded (``LayerResidency``, reshard_after_forward), each layer around its forward and its
backward, reduce-scattering its gradients after each micro-batch's backward so that whole gradients
exist one layer at a time, and trains exactly as plain AdamW in both cases."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipedream.config.specs import OptimSpec
from pipedream.errors import ConfigError
from pipedream.numerics import param_gathers
from pipedream.numerics.optim import build_optimizer, build_sharded_optimizer
from pipedream.numerics.param_residency import LayerResidency, added_everywhere, layer_buckets
from tests.support.single_process import world_of_one as one_rank_world

MICROBATCHES = 3


def adamw(zero: int) -> OptimSpec:
    return OptimSpec(name="adamw", weight_decay=0.1, fused=True, impl="torch", distributed=False, zero=zero,
                     betas=(0.9, 0.95), eps=1e-8)


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    with one_rank_world():
        yield


@pytest.fixture
def gathers(monkeypatch) -> list[int]:
    """The sizes of the parameters' all-gathers, in order."""
    calls: list[int] = []
    real = param_gathers.all_gather_flat

    def counted(out, mine, group=None, async_op=False):
        calls.append(out.numel())
        return real(out, mine, group=group, async_op=async_op)
    monkeypatch.setattr(param_gathers, "all_gather_flat", counted)
    return calls


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))


def _step(model: nn.Module, optimizer, sync, step: int) -> None:
    optimizer.zero_grad(set_to_none=True)
    for micro in range(MICROBATCHES):
        inputs = torch.randn(4, 3, generator=torch.Generator().manual_seed(10 * step + micro))
        model(inputs).square().mean().backward()
    sync()
    optimizer.step()


def _plain(steps: int) -> nn.Module:
    model = _model()
    optimizer = build_optimizer(adamw(0), list(model.parameters()), 1e-2)
    for step in range(steps):
        _step(model, optimizer, lambda: None, step)
    return model


def test_zero2_holds_no_gradient_between_steps() -> None:
    model = _model()
    optimizer = build_sharded_optimizer(adamw(2), list(model.parameters()), 1e-2, None, 1, 0, bucket_bytes=12)
    for step in range(3):
        _step(model, optimizer, optimizer.reduce_gradients, step)
        assert optimizer._grad_shard is None and all(p.grad is None for p in model.parameters())
        assert all(piece.view.grad is None for piece in optimizer.pieces)
    for a, b in zip(_plain(3).parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_zero3_frees_parameters_and_gathers_once_per_step(gathers: list[int]) -> None:
    model = _model()
    params = list(model.parameters())   # buckets of >= 12 bytes, last layer first: [2, 10], [5], [15]
    optimizer = build_sharded_optimizer(adamw(3), params, 1e-2, None, 1, 0, bucket_bytes=12)
    optimizer.shard_parameters([list(model)])
    assert all(p.untyped_storage().nbytes() == 0 for p in params)   # sharded at rest from the start
    for step in range(3):
        gathers.clear()
        _step(model, optimizer, optimizer.reduce_gradients, step)
        assert all(p.untyped_storage().nbytes() == 0 for p in params) and all(p.grad is None for p in params)
        assert len(gathers) == 3, gathers   # one gather per bucket and step
    optimizer.whole_parameters()
    for a, b in zip(_plain(3).parameters(), params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fully_sharded_holds_one_layer_whole_and_trains_exactly(gathers: list[int]) -> None:
    model = _model()
    params = list(model.parameters())
    buckets = layer_buckets([list(model)], params)
    assert buckets == [params[2:], params[:2]]   # one per layer with parameters, last layer first
    optimizer = build_sharded_optimizer(adamw(3), params, 1e-2, None, 1, 0, buckets=buckets)
    optimizer.shard_parameters([list(model)])
    LayerResidency(optimizer, [list(model)])
    whole = []   # at each sample: (parameters whole, gradients whole)

    def observe():
        whole.append(({i for i, p in enumerate(params) if p.untyped_storage().nbytes()},
                      {i for i, p in enumerate(params) if p.grad is not None}))
    optimizer.observe = observe
    for step in range(3):
        gathers.clear()
        _step(model, optimizer, optimizer.reduce_gradients, step)
        assert all(p.untyped_storage().nbytes() == 0 for p in params) and all(p.grad is None for p in params)
        # per micro-batch each layer is gathered for its forward and again for its backward
        assert len(gathers) == 2 * 2 * MICROBATCHES, gathers
    for present, grads in whole:   # never both layers' gradients, never both layers' parameters
        assert grads in (set(), {0, 1}, {2, 3}) and present in (set(), {0, 1}, {2, 3}), whole
    assert ({0, 1}, {0, 1}) in whole and ({2, 3}, {2, 3}) in whole
    optimizer.whole_parameters()
    for a, b in zip(_plain(3).parameters(), params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_layer_closes_once_every_parameter_has_a_gradient_per_backward_begun() -> None:
    a, b = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    assert not added_everywhere([a, b], {}, 0)
    assert not added_everywhere([a, b], {id(a): 1}, 1)   # b's (a held weight GEMM) still to come
    assert added_everywhere([a, b], {id(a): 1, id(b): 1}, 1)
    assert not added_everywhere([a, b], {id(a): 2, id(b): 1}, 2)   # two backwards begun, one W run
    assert added_everywhere([a, b], {id(a): 2, id(b): 2}, 2)


def test_zero3_takes_its_shard_of_loaded_parameters() -> None:
    model = _model()
    optimizer = build_sharded_optimizer(adamw(3), list(model.parameters()), 1e-2, None, 1, 0)
    optimizer.whole_parameters()
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(0.5)
    optimizer.parameters_loaded()
    optimizer.release(range(len(optimizer.buckets)))
    optimizer.whole_parameters()
    assert all(bool((p == 0.5).all()) for p in model.parameters())


def test_zero3_refuses_parameters_sharing_a_storage() -> None:
    weight = torch.zeros(4, 4)
    halves = [nn.Parameter(weight[:2]), nn.Parameter(weight[2:])]
    with pytest.raises(ConfigError, match="shares its storage: use optim.distributed=zero2"):
        build_sharded_optimizer(adamw(3), halves, 1e-2, None, 1, 0)
