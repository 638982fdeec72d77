"""Shapes of the tensors crossing each stage boundary, found by running the layers on the meta
device (no memory, no compute), so receivers can allocate buffers without a handshake."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from models.spec import LayerModel

from models import boundary
from models.boundary import Spec
from pipedream.errors import DataError, InvariantError


class BoundaryShapes:
    """For an input shape, the (shape, dtype) of every virtual stage's input and output (a
    ``TupleSpec`` where a tuple of tensors crosses). ``input_shape`` is ``boundary.shape_key`` of
    the model's input and ``input_dtype`` its ``boundary.dtypes``."""

    def __init__(self, model: LayerModel, bounds: list[tuple[int, int]],
                 input_dtype: torch.dtype | tuple[torch.dtype, ...]):
        self.model = model
        self.bounds = bounds
        self.input_dtype = input_dtype
        self._cache: dict[tuple, list[Spec]] = {}
        self._meta_layers: list[torch.nn.Module] | None = None

    def _layers(self) -> list[torch.nn.Module]:
        if self._meta_layers is None:
            with torch.device("meta"):
                built = self.model.build()
            self._meta_layers = [built[i] for i in range(self.model.num_layers)]
        return self._meta_layers

    def outputs(self, input_shape: tuple) -> list[Spec]:
        """Output spec of each virtual stage for a micro-batch input of ``input_shape``."""
        key = tuple(input_shape)
        if key not in self._cache:
            layers = self._layers()
            x = boundary.meta_value(key, self.input_dtype)
            specs = []
            with torch.no_grad():
                for start, end in self.bounds:
                    for layer in layers[start:end]:
                        x = boundary.call_layer(layer, x)
                    specs.append(boundary.spec_of(x))
            self._cache[key] = specs
        return self._cache[key]

    def stage_input(self, input_shape: tuple, virtual_stage: int) -> Spec:
        if virtual_stage == 0:
            return boundary.spec_of(boundary.meta_value(input_shape, self.input_dtype))
        return self.outputs(input_shape)[virtual_stage - 1]

    def stage_output(self, input_shape: tuple, virtual_stage: int) -> Spec:
        return self.outputs(input_shape)[virtual_stage]


def input_shapes(batches: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> dict[int, tuple]:
    return {microbatch: boundary.shape_key(inputs) for microbatch, (inputs, _) in batches.items()}


class InputShapes:
    """Every rank knows each micro-batch's input shape (the data order is deterministic), so
    receivers size their buffers without asking. Flush schedules allow a shape per micro-batch
    (``current``, set each step); asynchronous schedules keep micro-batches of earlier steps in
    flight under segment-local ids, so they need one shape for the whole run (``run``)."""

    def __init__(self) -> None:
        self.current: dict[int, tuple[int, ...]] = {}
        self.run: tuple[int, ...] | None = None

    def of(self, microbatch: int) -> tuple[int, ...]:
        shape = self.current.get(microbatch, self.run)
        if shape is None:
            raise InvariantError(f"no input shape is known for micro-batch {microbatch}")
        return shape

    def fix_run_shape(self, batches: dict[int, tuple[torch.Tensor, torch.Tensor]], schedule: str) -> None:
        for shape in input_shapes(batches).values():
            if self.run is None:
                self.run = shape
            elif shape != self.run:
                raise DataError(f"schedule={schedule} needs every micro-batch of a run to have the same shape: got "
                                f"{shape} after {self.run}; pad the data to one shape or use a flush schedule "
                                f"(1f1b, gpipe, interleaved)")

    @contextmanager
    def evaluating(self, batches: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
        """Evaluation's micro-batches have their own shapes; training's are restored afterwards."""
        training, self.current = self.current, input_shapes(batches)
        try:
            yield
        finally:
            self.current = training
