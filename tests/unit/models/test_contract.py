"""The public model contract: ``from_modules`` (flattening, tied parameters, meta builds, example
batches) and tuples of tensors crossing stage boundaries (packing, shapes, a two-stage backward
equal to the whole model's)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models import PipelineSequential, from_modules
from models.contract import SequentialCall, layer_type_name
from models import boundary
from models.boundary import TupleSpec
from pipedream.runtime.shapes import BoundaryShapes
from pipedream.runtime.stage import Stage


class Scale(nn.Module):
    """Takes and returns (hidden, mask), one tuple as nn.Sequential passes it: a two-tensor boundary."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, mask = inputs
        return torch.tanh(self.linear(hidden)) * mask.unsqueeze(-1), mask


class Split(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x[..., 0] > 0


class Pool(nn.Module):
    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden, mask = inputs
        return (hidden * mask.unsqueeze(-1)).sum(1)


def masked_model(width: int = 6):
    torch.manual_seed(0)
    layers = nn.Sequential(Split(), nn.Sequential(Scale(width), Scale(width)), Scale(width), Pool())
    example = (torch.randn(2, 5, width), torch.randn(2, width))
    return layers, from_modules(layers, F.mse_loss, example, name="masked")


def test_nested_sequentials_flatten_into_pipeline_layers():
    layers, model = masked_model()
    assert model.num_layers == 5
    assert [layer_type_name(model.build_layer(i)) for i in range(5)] == ["Split", "Scale", "Scale", "Scale", "Pool"]


def test_a_sequential_subclass_stays_one_layer():
    class Block(nn.Sequential):
        def forward(self, x):
            return x + super().forward(x)

    model = from_modules([Block(nn.Linear(3, 3)), nn.Linear(3, 1)], F.mse_loss, (torch.randn(2, 3), torch.randn(2, 1)))
    assert model.num_layers == 2


def test_the_built_model_equals_the_modules():
    layers, model = masked_model()
    x = torch.randn(3, 5, 6)
    torch.testing.assert_close(model.build_sequential()(x), layers(x), rtol=0, atol=0)


def test_modules_are_called_as_nn_sequential_calls_them():
    """The runtime unpacks a tuple into a layer's arguments; a from_modules layer packs it back, so
    a module passing (hidden, mask) on gets it as one argument, in plain PyTorch and here alike."""
    layer = SequentialCall(Scale(4))
    hidden, mask = torch.randn(2, 3, 4), torch.ones(2, 3, dtype=torch.bool)
    expected = layer.module((hidden, mask))
    for got in (boundary.call_layer(layer, (hidden, mask)), layer((hidden, mask))):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    linear = SequentialCall(nn.Linear(4, 2))
    torch.testing.assert_close(boundary.call_layer(linear, hidden), linear.module(hidden), rtol=0, atol=0)
    assert [name for name, _ in layer.named_parameters()] == ["module.linear.weight", "module.linear.bias"]
    first = nn.Sequential(nn.Identity(), Scale(4))   # a tuple as the model's input too
    model = from_modules(first, F.mse_loss, ((hidden, mask), torch.randn(2, 3, 4)))
    torch.testing.assert_close(model.build_sequential()((hidden, mask))[0], first((hidden, mask))[0], rtol=0, atol=0)


def test_a_pipeline_sequential_keeps_unpacking():
    class Add(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a + b

    model = from_modules(PipelineSequential(Add()), F.mse_loss, ((torch.ones(2), torch.ones(2)), torch.ones(2)))
    assert type(model.build_layer(0)) is Add
    torch.testing.assert_close(model.build_sequential()((torch.ones(2), torch.ones(2))), torch.full((2,), 2.0))


def test_layers_are_fresh_copies_and_meta_builds_copy_no_data():
    layers, model = masked_model()
    first, second = model.build_layer(1), model.build_layer(1)
    assert first is not second and first.module.linear.weight is not second.module.linear.weight
    torch.testing.assert_close(first.module.linear.weight, layers[1][0].linear.weight, rtol=0, atol=0)
    with torch.device("meta"):
        meta = model.build()
    assert all(p.is_meta for layer in meta.values() for p in layer.parameters())
    assert not layers[1][0].linear.weight.is_meta


def test_shared_parameters_become_tied_groups():
    embed, head = nn.Linear(4, 8, bias=False), nn.Linear(8, 4, bias=False)
    head.weight = nn.Parameter(embed.weight.detach().t().contiguous())   # not shared: no group
    shared = nn.Linear(8, 8)
    model = from_modules([embed, shared, nn.ReLU(), nn.Sequential(shared)], F.mse_loss,
                         (torch.randn(2, 4), torch.randn(2, 8)))
    assert model.tied == (((1, "module.weight"), (3, "module.weight")), ((1, "module.bias"), (3, "module.bias")))
    built = model.build()
    assert built[1].module.weight is built[3].module.weight and built[1].module.bias is built[3].module.bias
    alone = model.build([3])
    torch.testing.assert_close(alone[3].module.weight, shared.weight, rtol=0, atol=0)


def test_make_batch_follows_the_example():
    example_input = (torch.randn(2, 5, 3), torch.ones(2, 5, dtype=torch.bool), torch.randint(3, 7, (2, 5)))
    model = from_modules([nn.Identity()], F.mse_loss, (example_input, torch.randint(0, 4, (2,))))
    (x, mask, tokens), target = model.make_batch(9, torch.Generator().manual_seed(0))
    assert x.shape == (9, 5, 3) and x.dtype == torch.float32
    assert mask.shape == (9, 5) and mask.dtype == torch.bool
    assert tokens.dtype == torch.int64 and int(tokens.min()) >= 3 and int(tokens.max()) <= 6
    assert target.shape == (9,) and int(target.max()) <= 3


def test_tuples_pack_into_one_aligned_message():
    members = (torch.randn(3, 5), torch.rand(3, 5) > 0.5, torch.arange(3), torch.randn(2, dtype=torch.float64))
    spec = boundary.spec_of(members)
    for parts in (1, 2, 3):
        packed = boundary.pack(members, parts)
        assert packed.dtype == torch.uint8 and packed.numel() == spec.packed_bytes(parts)
        assert packed.numel() % (boundary.ALIGN * parts) == 0
        rejoined = torch.cat(list(packed.chunk(parts)))   # what scatter/gather hands back
        for sent, received in zip(members, spec.unpack(rejoined)):
            assert received.dtype == sent.dtype
            torch.testing.assert_close(received, sent, rtol=0, atol=0)
    assert spec.grads() == TupleSpec(((members[0].shape, torch.float32), (members[3].shape, torch.float64)))


def test_boundary_shapes_of_tuples():
    _, model = masked_model()
    shapes = BoundaryShapes(model, [(0, 2), (2, 5)], torch.float32)
    first, last = shapes.outputs((4, 5, 6))
    assert first == TupleSpec(((torch.Size([4, 5, 6]), torch.float32), (torch.Size([4, 5]), torch.bool)))
    assert boundary.grad_spec(first) == TupleSpec(((torch.Size([4, 5, 6]), torch.float32),))
    assert last == (torch.Size([4, 6]), torch.float32)


def test_a_two_stage_tuple_backward_equals_the_whole_models():
    _, model = masked_model()
    x, y = model.make_batch(4, torch.Generator().manual_seed(1))
    whole = model.build_sequential()
    F.mse_loss(whole(x), y).backward()
    built = model.build()
    first = Stage([PipelineSequential(built[0], built[1])], [True], [False], model.loss_fn)
    last = Stage([PipelineSequential(built[2], built[3], built[4])], [False], [True], model.loss_fn)
    sent = first.forward(0, 0, x)
    assert isinstance(sent, tuple) and sent[1].dtype == torch.bool
    received = boundary.pack(sent, 1)
    last.forward(0, 0, boundary.spec_of(sent).unpack(received), y)
    grads = last.backward(0, 0)
    assert isinstance(grads, tuple) and len(grads) == 1   # the mask has no gradient
    first.backward(0, 0, grads)
    for (name, expected), got in zip(whole.named_parameters(), [p for i in range(5) for p in built[i].parameters()]):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-6, atol=1e-7, msg=name)
    assert first.stats.in_flight == last.stats.in_flight == 0
