"""Swap or recompute per feature map: the memory simulator, the greedy plan, and the runtime
that keeps each fused group's saved tensors, copies them to the host tier, or recomputes them,
with values and gradients unchanged and every held byte counted."""
from __future__ import annotations

import pytest
import torch

from models.families.mlp import mlp_model
from models.boundary import call_layer
from pipedream.multi_model.feature_plan import (BudgetTooSmall, Decision, Event, FeatureMap, plan, simulate)
from pipedream.multi_model.fused import fuse_models
from pipedream.multi_model.memory import FeatureMapMemory
from pipedream.multi_model.spec import MultiModelSpec
from pipedream.offload import DeviceTier, HostTier

MAPS = [FeatureMap(0, n, n // 2, n % 2, nbytes=100 * (n + 1), forward_s=1.0, backward_s=2.0) for n in range(4)]
ONE = [Event(False, 0, 0), Event(True, 0, 0)]
TWO_IN_FLIGHT = [Event(False, 0, 0), Event(False, 1, 0), Event(True, 0, 0), Event(True, 1, 0)]


def test_simulator_counts_kept_maps_until_their_backward():
    assert simulate(MAPS, {}, ONE, base_bytes=50) == 50 + 1000
    assert simulate(MAPS, {}, TWO_IN_FLIGHT, base_bytes=50) == 50 + 2000


def test_simulator_counts_swapped_maps_from_their_prefetch_and_recomputed_ones_in_their_backward():
    # node 0 swapped: two micro-batches hold nodes 1-3 only; node 0 comes back when node 1's
    # backward starts, after nodes 2 and 3 have left
    assert simulate(MAPS, {(0, 0): Decision.SWAP}, TWO_IN_FLIGHT, base_bytes=0) == 2 * 900
    # a prefetch adds to what the backward holds: node 2 swapped returns beside node 3
    assert simulate(MAPS, {(0, 2): Decision.SWAP}, ONE, base_bytes=0) == 700 + 300
    recomputed = simulate(MAPS, {(0, 3): Decision.RECOMPUTE}, ONE, base_bytes=0)
    assert recomputed == 600 + 400   # node 3 comes back in its own backward, with nodes 0-2 still held


def test_plan_meets_the_budget_swapping_when_copies_are_cheap_and_recomputing_when_not():
    fast = plan(MAPS, TWO_IN_FLIGHT, 0, budget_bytes=1500, copy_bytes_per_s=1e12, overlapped_copies=True)
    assert fast.unoptimised_peak_bytes == 2000 and fast.planned_peak_bytes <= 1500
    assert set(fast.decisions.values()) == {Decision.SWAP}
    slow = plan(MAPS, TWO_IN_FLIGHT, 0, budget_bytes=1500, copy_bytes_per_s=1.0, overlapped_copies=False)
    assert slow.planned_peak_bytes <= 1500 and set(slow.decisions.values()) == {Decision.RECOMPUTE}
    # the longest inactive map is node 0: swapped first
    first = plan(MAPS, ONE, 0, budget_bytes=999, copy_bytes_per_s=1e12, overlapped_copies=True)
    assert first.decisions == {(0, 0): Decision.SWAP}


def test_a_budget_below_every_option_is_refused_in_one_line():
    with pytest.raises(BudgetTooSmall, match="memory.device_budget_bytes=10 is below") as error:
        plan(MAPS, ONE, 50, budget_bytes=10, copy_bytes_per_s=1e12, overlapped_copies=True)
    assert "\n" not in str(error.value)


def _run(decisions, budget=1 << 40):
    torch.manual_seed(0)
    members = [mlp_model(2, 8, seed=k) for k in range(2)]
    layers = fuse_models(members, MultiModelSpec((), None), groups=2).build()
    params = [p for i in range(2) for p in layers[i].parameters()]
    memory = None
    if decisions is not None:
        memory = FeatureMapMemory(DeviceTier(HostTier(), "cpu", budget), decisions, params)
        for layer in layers.values():
            layer.__dict__["memory"] = memory
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    value = x
    for i in range(2):
        value = call_layer(layers[i], value)
    value.pow(2).sum().backward()
    if memory is not None:
        memory.end_step()
    return value.detach(), [p.grad.clone() for p in params], memory, sum(p.nbytes for p in params)


def test_swapped_and_recomputed_groups_give_the_same_values_and_gradients():
    expected, expected_grads, _, _ = _run(None)
    decisions = {(0, 0): Decision.SWAP, (0, 1): Decision.RECOMPUTE, (1, 0): Decision.RECOMPUTE,
                 (1, 1): Decision.SWAP}
    value, grads, memory, weights = _run(decisions)
    assert torch.equal(value, expected)
    for grad, reference in zip(grads, expected_grads):
        torch.testing.assert_close(grad, reference, rtol=0, atol=0)
    moved = memory.tier.counters.as_dict()["activations"]
    assert moved["device_to_host"] == moved["host_to_device"] > 0
    assert memory.tier.resident_bytes == weights   # every feature map released after the backward


def test_kept_maps_are_counted_and_a_budget_breach_stops_the_step():
    _, _, kept, weights = _run({})
    assert kept.tier.peak_resident_bytes > weights
    from pipedream.offload import DeviceBudgetError
    with pytest.raises(DeviceBudgetError):
        _run({}, budget=weights + 16)


def test_a_recomputed_group_draws_the_same_dropout_masks():
    import torch.nn.functional as F
    from torch import nn

    from models import from_modules

    def grads(decision):
        torch.manual_seed(0)
        members = [from_modules(nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5), nn.Linear(6, 2)), F.mse_loss,
                                (torch.randn(2, 4), torch.randn(2, 2))) for _ in range(2)]
        layers = fuse_models(members, MultiModelSpec((), None)).build()
        params = [p for layer in layers.values() for p in layer.parameters()]
        memory = FeatureMapMemory(DeviceTier(HostTier(), "cpu", 1 << 40), {(1, 0): decision}, params)
        for layer in layers.values():
            layer.__dict__["memory"] = memory
        value = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(2))
        torch.manual_seed(3)
        for i in range(3):
            value = call_layer(layers[i], value)
        value.sum().backward()
        return [p.grad for p in params]

    for kept, recomputed in zip(grads(Decision.KEEP), grads(Decision.RECOMPUTE)):
        assert torch.equal(kept, recomputed)
