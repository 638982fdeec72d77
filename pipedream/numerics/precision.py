"""Mixed precision (``precision=fp32|bf16|fp16``): torch.amp autocast over fp32 parameters.

The parameters, their gradients and the optimizer state stay fp32 (the parameters are the master
weights); each chunk's forward runs under ``torch.autocast`` in the compute dtype, and every
pipeline layer's floating-point output is cast to it. So the tensors that cross a stage boundary,
and the gradients that come back, are in the compute dtype (half of fp32's bytes on the wire),
and a pipeline computes exactly what the same model computes in one process under the same
scheme, whatever the split (``apply`` is used by both). The loss is taken in fp32 (as Megatron's
cross entropy on ``logits.float()``). Why this scheme rather than low-precision parameters with fp32
main gradients: docs/design.md, Mixed precision.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from models.boundary import Spec, TupleSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class MixedPrecision:
    """How one rank computes: ``name`` is the config's precision, ``device_type`` autocast's device
    (``cuda`` on GPUs, ``cpu`` here)."""

    name: str
    device_type: str

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    @property
    def enabled(self) -> bool:
        return self.name != "fp32"

    def autocast(self) -> AbstractContextManager:
        """The context a chunk's forward runs in (autocast's weight-cast cache lives as long as it)."""
        if not self.enabled:
            return nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def cast_outputs(self, layer: nn.Module) -> None:
        """Every floating-point output of ``layer`` leaves in the compute dtype (a forward hook, so
        parameter names and the state dict stay those of the fp32 model)."""
        if self.enabled:
            dtype = self.dtype
            layer.register_forward_hook(lambda module, inputs, output: _to_dtype(output, dtype))

    def apply(self, layers: list[nn.Module]) -> None:
        for layer in layers:
            self.cast_outputs(layer)

    def fp32_loss(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """The loss on fp32 logits: a half-precision log-softmax over a vocabulary loses digits."""
        if not self.enabled:
            return loss_fn
        return lambda outputs, targets, *rest: loss_fn(_to_dtype(outputs, torch.float32), targets, *rest)

    def on_wire(self, spec: Spec) -> Spec:
        """A boundary's spec as it travels: floating-point tensors (and tuple members) in the
        compute dtype, as the output hooks leave them; integer and boolean ones unchanged."""
        if not self.enabled:
            return spec
        if isinstance(spec, TupleSpec):
            return TupleSpec(tuple(self.on_wire(member) for member in spec.members))
        shape, dtype = spec
        return shape, (self.dtype if dtype.is_floating_point else dtype)


def _to_dtype(output: Any, dtype: torch.dtype) -> Any:
    if isinstance(output, torch.Tensor):
        return output.to(dtype) if output.is_floating_point() else output
    if isinstance(output, (tuple, list)):
        return type(output)(_to_dtype(item, dtype) for item in output)
    return output
