"""The distributed optimizer's pieces and its whole-model checkpoint form, in a Gloo world of one
(dp = 1: the collectives are identities), against plain AdamW."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipedream.config.specs import OptimSpec
from pipedream.numerics.optim import build_optimizer, build_sharded_optimizer, optimizer_state_bytes
from tests.support.single_process import world_of_one as one_rank_world

ADAMW = OptimSpec(name="adamw", weight_decay=0.1, fused=True, impl="torch", distributed=True, betas=(0.9, 0.95),
                  eps=1e-8)


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    with one_rank_world():
        yield


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))


def _train(model: nn.Module, optimizer, sync, steps: int) -> None:
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(4, 3, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        sync()
        optimizer.step()


def test_shards_cover_every_element_once_in_order() -> None:
    params = list(_model().parameters())   # 15 + 5 + 10 + 2 = 32 elements
    covered = []
    for rank in range(3):
        sharded = build_sharded_optimizer(ADAMW, params, 1e-2, None, 3, rank)
        assert sharded.shard_numel == 11
        covered += [(id(p.param), p.begin, p.end) for p in sharded.pieces]
        for piece in sharded.pieces:   # views share the parameters' storage
            assert piece.view.data_ptr() == piece.param.data.view(-1)[piece.begin:].data_ptr()
    by_param: dict[int, list[tuple[int, int]]] = {}
    for key, begin, end in covered:
        by_param.setdefault(key, []).append((begin, end))
    for param in params:
        ranges = sorted(by_param[id(param)])
        assert ranges[0][0] == 0 and ranges[-1][1] == param.numel()
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_updates_and_checkpoint_form_equal_plain_adamw() -> None:
    plain_model, sharded_model = _model(), _model()
    plain = build_optimizer(ADAMW, list(plain_model.parameters()), 1e-2)
    sharded = build_sharded_optimizer(ADAMW, list(sharded_model.parameters()), 1e-2, None, 1, 0)
    _train(plain_model, plain, lambda: None, 3)
    _train(sharded_model, sharded, sharded.reduce_gradients, 3)
    for a, b in zip(plain_model.parameters(), sharded_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    whole, mine = plain.state_dict(), sharded.state_dict()
    assert mine["state"].keys() == whole["state"].keys()
    for index, state in whole["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(mine["state"][index][name], value, rtol=0, atol=0)
    assert [g["params"] for g in mine["param_groups"]] == [g["params"] for g in whole["param_groups"]]
    assert optimizer_state_bytes(sharded) == optimizer_state_bytes(plain) - 4 * 4 + 4 * len(sharded.pieces)

    # a plain optimizer's state loads into a fresh sharded one, which then continues identically
    resumed_model = _model()
    resumed_model.load_state_dict(plain_model.state_dict())
    resumed = build_sharded_optimizer(ADAMW, list(resumed_model.parameters()), 1e-2, None, 1, 0)
    resumed.load_state_dict(whole)
    _train(plain_model, plain, lambda: None, 2)
    _train(resumed_model, resumed, resumed.reduce_gradients, 2)
    for a, b in zip(plain_model.parameters(), resumed_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_buckets_are_sharded_one_by_one_and_gathered_back_in_place(monkeypatch) -> None:
    """train.overlap_grad_reduce: the flat order is the buckets' (reverse order of use), each bucket
    cut into dp parts of ceil(numel / dp); every element is owned once, and the all-gather of the
    ranks' shards puts every element back where it belongs."""
    from pipedream.numerics import param_gathers

    params = list(_model().parameters())   # buckets of >= 12 bytes, last layer first: [2, 10], [5], [15]
    ranks = [build_sharded_optimizer(ADAMW, params, 1e-2, None, 3, rank, bucket_bytes=12) for rank in range(3)]
    assert [[p.numel() for p in b.params] for b in ranks[0].buckets] == [[2, 10], [5], [15]]
    assert ranks[0].shard_numel == 4 + 2 + 5
    owned = sorted((id(p.param), p.begin, p.end) for opt in ranks for p in opt.pieces)
    for param in params:
        ranges = [(b, e) for key, b, e in owned if key == id(param)]
        assert ranges[0][0] == 0 and ranges[-1][1] == param.numel() and all(
            a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    for opt in ranks:
        for piece in opt.pieces:
            opt._mine[piece.shard_offset:piece.shard_offset + piece.end - piece.begin].copy_(piece.view)

    def all_gather(out, _mine, group=None, async_op=False):
        out.copy_(torch.cat([opt._mine for opt in ranks]))
    monkeypatch.setattr(param_gathers, "all_gather_flat", all_gather)
    flat = ranks[1]._all_gathered()
    for param in params:
        offset = ranks[1].offsets[id(param)]
        torch.testing.assert_close(flat[offset:offset + param.numel()], param.detach().reshape(-1), rtol=0, atol=0)


@pytest.mark.parametrize("tied", [False, True])
def test_overlapped_reduce_scatter_trains_as_plain_adamw(tied: bool) -> None:
    """ShardedReduction: buckets leave as the backward finishes them (a held one waits for the sync);
    the updates are plain AdamW's."""
    from pipedream.numerics.sharded_reduction import ShardedReduction

    plain_model, sharded_model = _model(), _model()
    plain = build_optimizer(ADAMW, list(plain_model.parameters()), 1e-2)
    params = list(sharded_model.parameters())
    sharded = build_sharded_optimizer(ADAMW, params, 1e-2, None, 1, 0, bucket_bytes=12)
    reduction = ShardedReduction(sharded, {id(params[0])} if tied else set())
    assert len(reduction.buckets) == 3 and (not tied or params[0] in reduction.buckets[-1].params)
    _train(plain_model, plain, lambda: None, 3)
    _train(sharded_model, sharded, reduction.finish, 3)
    for a, b in zip(plain_model.parameters(), sharded_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gather_before_lands_each_bucket_at_its_layers_forward() -> None:
    """``gather_before``: ``step`` leaves the all-gathers in flight and a layer's forward lands the
    buckets of its parameters, no others (here a parameter overwritten after the step, as a
    stale copy on another rank, is restored only when its own layer runs)."""
    plain_model, model = _model(), _model()
    plain = build_optimizer(ADAMW, list(plain_model.parameters()), 1e-2)
    sharded = build_sharded_optimizer(ADAMW, list(model.parameters()), 1e-2, None, 1, 0, bucket_bytes=1)
    sharded.gather_before([model[0], model[2]])
    _train(plain_model, plain, lambda: None, 1)
    _train(model, sharded, sharded.reduce_gradients, 1)
    first, last = model[0].weight, model[2].weight
    assert len(sharded._gathers) == len(sharded.buckets) == 4   # one bucket per parameter, all in flight
    with torch.no_grad():
        first.zero_()
        last.zero_()
    model[0](torch.ones(1, 3))
    assert first.abs().sum() > 0 and last.abs().sum() == 0   # the first layer's buckets only
    model[2](torch.ones(1, 5))
    assert not sharded._gathers
    for a, b in zip(plain_model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the next step waits for anything still in flight before updating the pieces
    _train(plain_model, plain, lambda: None, 2)
    _train(model, sharded, sharded.reduce_gradients, 2)
    sharded.wait_parameters()
    for a, b in zip(plain_model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gather_before_refuses_parameters_outside_the_layers() -> None:
    model = _model()
    sharded = build_sharded_optimizer(ADAMW, list(model.parameters()), 1e-2, None, 1, 0, bucket_bytes=1)
    with pytest.raises(ValueError, match="every parameter"):
        sharded.gather_before([model[0]])
