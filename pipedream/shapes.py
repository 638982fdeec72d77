"""Shapes of the tensors crossing each stage boundary, found by running the layers on the meta
device (no memory, no compute), so receivers can allocate buffers without a handshake."""
from __future__ import annotations

import torch

from models.spec import LayerModel

TensorSpec = tuple[torch.Size, torch.dtype]


class BoundaryShapes:
    """For an input shape, the (shape, dtype) of every virtual stage's input and output."""

    def __init__(self, model: LayerModel, bounds: list[tuple[int, int]], input_dtype: torch.dtype):
        self.model = model
        self.bounds = bounds
        self.input_dtype = input_dtype
        self._cache: dict[tuple[int, ...], list[TensorSpec]] = {}
        self._meta_layers: list[torch.nn.Module] | None = None

    def _layers(self) -> list[torch.nn.Module]:
        if self._meta_layers is None:
            with torch.device("meta"):
                built = self.model.build()
            self._meta_layers = [built[i] for i in range(self.model.num_layers)]
        return self._meta_layers

    def outputs(self, input_shape: tuple[int, ...]) -> list[TensorSpec]:
        """Output spec of each virtual stage for a micro-batch input of ``input_shape``."""
        key = tuple(input_shape)
        if key not in self._cache:
            layers = self._layers()
            x = torch.empty(key, dtype=self.input_dtype, device="meta")
            specs = []
            with torch.no_grad():
                for start, end in self.bounds:
                    for layer in layers[start:end]:
                        x = layer(x)
                    specs.append((x.shape, x.dtype))
            self._cache[key] = specs
        return self._cache[key]

    def stage_input(self, input_shape: tuple[int, ...], virtual_stage: int) -> TensorSpec:
        if virtual_stage == 0:
            return torch.Size(input_shape), self.input_dtype
        return self.outputs(input_shape)[virtual_stage - 1]

    def stage_output(self, input_shape: tuple[int, ...], virtual_stage: int) -> TensorSpec:
        return self.outputs(input_shape)[virtual_stage]
