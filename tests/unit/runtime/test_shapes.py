"""BoundaryShapes: every virtual stage's input and output spec for a micro-batch shape, found on
the meta device and computed once per shape."""
from __future__ import annotations

import torch
from torch import nn

from models.spec import LayerModel
from pipedream.runtime.shapes import BoundaryShapes


def token_model(devices: list[torch.device]) -> LayerModel:
    """Embedding -> Linear -> Flatten -> row sum -> half precision; ``devices`` logs where each
    layer is built."""
    vocab, hidden = 11, 6

    def build_layer(index: int) -> nn.Module:
        devices.append(torch.empty(0).device)
        return [nn.Embedding(vocab, hidden), nn.Linear(hidden, 4), nn.Flatten(1), _RowSum(), _Half()][index]

    def make_batch(batch: int, generator: torch.Generator):
        return torch.randint(0, vocab, (batch, 3), generator=generator), torch.zeros(batch, 1)

    return LayerModel("tokens", 5, build_layer, nn.functional.mse_loss, make_batch)


class _RowSum(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(-1, keepdim=True)


class _Half(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.half()


def test_stage_specs_follow_the_input_shape():
    devices: list[torch.device] = []
    shapes = BoundaryShapes(token_model(devices), [(0, 2), (2, 3), (3, 5)], torch.long)
    assert shapes.outputs((2, 3)) == [(torch.Size([2, 3, 4]), torch.float32), (torch.Size([2, 12]), torch.float32),
                                      (torch.Size([2, 1]), torch.float16)]
    assert shapes.stage_input((2, 3), 0) == (torch.Size([2, 3]), torch.long)
    assert shapes.stage_input((2, 3), 2) == (torch.Size([2, 12]), torch.float32)
    assert shapes.stage_output((2, 3), 1) == (torch.Size([2, 12]), torch.float32)
    # another micro-batch shape (a shorter sequence, a smaller batch) gets its own specs
    assert shapes.stage_input((1, 7), 1) == (torch.Size([1, 7, 4]), torch.float32)
    assert shapes.stage_output((1, 7), 2) == (torch.Size([1, 1]), torch.float16)


def test_layers_are_built_once_on_the_meta_device():
    devices: list[torch.device] = []
    shapes = BoundaryShapes(token_model(devices), [(0, 3), (3, 5)], torch.long)
    assert devices == []   # nothing is built before the first question
    first = shapes.outputs((4, 3))
    shapes.outputs((2, 3))
    assert shapes.outputs((4, 3)) is first   # cached per shape
    assert devices == [torch.device("meta")] * 5
