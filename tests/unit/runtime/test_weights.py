"""WeightStore: versions share storage with the parameters until an update needs them apart,
backwards land their gradients in the parameters, and no longer needed versions are freed."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from pipedream.schedules import Action, Kind
from pipedream.runtime.weights import WeightStore

F = [Action(Kind.FWD, mb, 0) for mb in range(3)]
B = [Action(Kind.BWD, mb, 0) for mb in range(3)]


def linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def run(chunk: nn.Module, store: WeightStore, action: Action, x: torch.Tensor) -> torch.Tensor:
    out = functional_call(chunk, store.weights_for(action), (x,))
    store.after_forward(action)
    return out


def sgd_update(store: WeightStore, params: list[nn.Parameter], lr: float = 0.5) -> None:
    store.before_update()
    with torch.no_grad():
        for p in params:
            p.sub_(lr * p.grad)   # in place, as torch.optim does
            p.grad = None
    store.after_update()


def expected_grad(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """d/dW of sum((x W^T + b)^2)."""
    return 2 * (x @ weight.t() + bias).t() @ x


def test_stashed_version_survives_an_update_and_gets_its_own_gradient():
    # a first stage of PipeDream: F1 runs before B0's update, so B1 uses the pre-update weights
    chunk = linear()
    params = list(chunk.parameters())
    store = WeightStore(params, [chunk], {F[0]: 0, F[1]: 0, B[0]: 0, F[2]: 1, B[1]: 0, B[2]: 1})
    initial = [p.detach().clone() for p in params]
    x = [torch.randn(4, 3, generator=torch.Generator().manual_seed(mb)) for mb in range(3)]

    y0, y1 = run(chunk, store, F[0], x[0]), run(chunk, store, F[1], x[1])
    version0 = store.versions[0]
    assert [t.data_ptr() for t in version0] == [p.data_ptr() for p in params]   # an alias, no copy yet
    y0.pow(2).sum().backward()
    store.after_backward(B[0])
    torch.testing.assert_close(params[0].grad, expected_grad(*initial, x[0]))
    assert all(t.grad is None for t in version0)   # moved, not copied

    sgd_update(store, params)
    assert store.current == 1 and store.held == 2 and store.peak == 2
    assert params[0].data_ptr() != version0[0].data_ptr()        # the parameters moved to a copy
    for kept, before in zip(version0, initial):
        assert torch.equal(kept, before)                        # ... and the stash kept the old values
    assert not torch.equal(params[0], initial[0])

    y2 = run(chunk, store, F[2], x[2])
    y1.pow(2).sum().backward()
    store.after_backward(B[1])
    torch.testing.assert_close(params[0].grad, expected_grad(*initial, x[1]))   # on version 0
    assert 0 not in store.versions and store.held == 1                         # its last use freed it
    with pytest.raises(RuntimeError, match="was freed"):
        store.weights_for(B[1])

    updated = [p.detach().clone() for p in params]
    y2.pow(2).sum().backward()
    store.after_backward(B[2])
    # B2 ran on version 1 (the updated weights) and adds to B1's gradient
    torch.testing.assert_close(params[0].grad, expected_grad(*initial, x[1]) + expected_grad(*updated, x[2]))
    assert store.peak == 2


def test_update_in_place_when_no_later_action_needs_the_version():
    chunk = linear()
    params = list(chunk.parameters())
    store = WeightStore(params, [chunk], {F[0]: 0, B[0]: 0, F[1]: 1, B[1]: 1})
    run(chunk, store, F[0], torch.ones(1, 3)).sum().backward()
    store.after_backward(B[0])
    storage = params[0].data_ptr()
    sgd_update(store, params)
    assert params[0].data_ptr() == storage and store.versions == {} and store.peak == 1


def test_gradients_of_two_backwards_on_one_version_add_up():
    chunk = linear()
    params = list(chunk.parameters())
    store = WeightStore(params, [chunk], {F[0]: 0, F[1]: 0, B[0]: 0, B[1]: 0})
    x0, x1 = torch.randn(2, 3), torch.randn(2, 3)
    y0, y1 = run(chunk, store, F[0], x0), run(chunk, store, F[1], x1)
    for y, backward in ((y0, B[0]), (y1, B[1])):
        y.pow(2).sum().backward()
        store.after_backward(backward)
    weight, bias = (p.detach() for p in params)
    torch.testing.assert_close(params[0].grad, expected_grad(weight, bias, x0) + expected_grad(weight, bias, x1))


def test_a_version_from_the_future_is_an_error():
    chunk = linear()
    store = WeightStore(list(chunk.parameters()), [chunk], {F[0]: 1, B[0]: 1})
    with pytest.raises(RuntimeError, match="is not created yet"):
        store.weights_for(F[0])


def test_weights_for_names_the_parameters_of_each_chunk():
    first, second = nn.Linear(2, 2), nn.Linear(2, 2, bias=False)
    params = list(first.parameters()) + list(second.parameters())
    chunk1 = Action(Kind.FWD, 0, 1)
    store = WeightStore(params, [first, second], {F[0]: 0, chunk1: 0})
    assert sorted(store.weights_for(F[0])) == ["bias", "weight"]
    weights = store.weights_for(chunk1)
    assert list(weights) == ["weight"] and weights["weight"].data_ptr() == second.weight.data_ptr()


def test_replan_keeps_executed_versions_and_frees_unneeded_ones():
    chunk = linear()
    params = list(chunk.parameters())
    store = WeightStore(params, [chunk], {F[0]: 0, F[1]: 0, B[0]: 0, B[1]: 0})
    run(chunk, store, F[0], torch.ones(1, 3))
    with pytest.raises(RuntimeError, match="changes the weight version"):
        store.replan({F[0]: 1, B[0]: 1}, executed=[F[0]], remaining=[B[0]])
    store.replan({F[0]: 0, B[0]: 0}, executed=[F[0]], remaining=[B[0]])
    assert store.pending[0] == 1 and store.uses == {F[0]: 0, B[0]: 0}
