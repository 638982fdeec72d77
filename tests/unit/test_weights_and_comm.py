"""Weight stashing (WeightStore) and the point-to-point tags, in one process."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from pipedream.comm import TAG_SPACE, message_tag
from pipedream.errors import InvariantError
from pipedream.schedules import Action, Kind
from pipedream.weights import WeightStore

F0, B0 = Action(Kind.FWD, 0), Action(Kind.BWD, 0)
F1, B1 = Action(Kind.FWD, 1), Action(Kind.BWD, 1)


def linear_store(uses: dict[Action, int]) -> tuple[nn.Linear, WeightStore]:
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    return layer, WeightStore(list(layer.parameters()), [layer], uses)


def run(store: WeightStore, layer: nn.Linear, forward: Action, inputs: torch.Tensor) -> torch.Tensor:
    weights = store.weights_for(forward)
    out = torch.func.functional_call(layer, weights, (inputs,)).sum()
    store.after_forward(forward)
    return out


def test_a_stashed_version_survives_the_update_and_its_backward_sees_the_old_weights():
    layer, store = linear_store({F0: 0, B0: 0, F1: 1, B1: 1})
    old_weight = layer.weight.detach().clone()
    inputs = torch.ones(1, 3)
    loss0 = run(store, layer, F0, inputs)
    store.before_update()                       # B0 still needs version 0: the parameters move
    with torch.no_grad():
        layer.weight.add_(1.0)
    store.after_update()
    assert store.held == 2 and store.peak == 2
    loss0.backward()
    store.after_backward(B0)                    # its gradient lands in the parameters' .grad
    assert store.held == 1                      # version 0 is freed after its last use
    torch.testing.assert_close(layer.weight.grad, torch.ones(2, 3))
    loss1 = run(store, layer, F1, inputs)       # the newest weights
    torch.testing.assert_close(loss1, (inputs @ (old_weight + 1).T + layer.bias).sum())


def test_an_update_with_no_later_user_copies_nothing():
    layer, store = linear_store({F0: 0, B0: 0, F1: 1, B1: 1})
    loss0 = run(store, layer, F0, torch.ones(1, 3))
    loss0.backward()
    store.after_backward(B0)
    storage = layer.weight.untyped_storage().data_ptr()
    store.before_update()
    store.after_update()
    assert layer.weight.untyped_storage().data_ptr() == storage and store.peak == 1


def test_a_version_the_plan_never_made_is_an_invariant_error():
    layer, store = linear_store({F0: 2, B0: 2})
    with pytest.raises(InvariantError, match="not created yet"):
        store.weights_for(F0)


def test_tags_are_distinct_per_microbatch_chunk_and_direction():
    vpp = 3
    tags = {message_tag(mb, chunk, vpp, grad)
            for mb, chunk, grad in itertools.product(range(50), range(vpp), (False, True))}
    assert len(tags) == 50 * vpp * 2 and all(0 <= t < TAG_SPACE for t in tags)
