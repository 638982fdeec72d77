"""Values that cross a stage boundary: one tensor (the common, fast path) or a tuple of tensors
(e.g. hidden states and an attention mask).

A layer that returns a tuple hands it to the next layer as separate arguments
(``models.contract.PipelineSequential``). Gradients travel back for the floating-point members
only (an integer or boolean mask has none); a member that received no gradient sends zeros, so
both sides of a channel know every message's layout from the shapes alone.

A tuple travels as one message: its members' bytes packed into one uint8 buffer, each member
padded to ``ALIGN`` bytes so the receiver views the buffer back without copying, and the whole
padded to a multiple of ``ALIGN`` x parts so it splits evenly under tensor-parallel
scatter/gather.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Union

import torch

Boundary = Union[torch.Tensor, tuple[torch.Tensor, ...]]
TensorSpec = tuple[torch.Size, torch.dtype]
ALIGN = 16   # the largest element size (complex128): every member starts aligned for its dtype


def carries_grad(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def tensors(value: Boundary) -> tuple[torch.Tensor, ...]:
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


def call_layer(layer: Any, value: Boundary) -> Boundary:
    """A tuple is unpacked into the layer's arguments; anything else is its one argument."""
    return layer(*value) if isinstance(value, tuple) else layer(value)


def detach(value: Boundary) -> Boundary:
    if isinstance(value, torch.Tensor):
        return value.detach()
    return tuple(t.detach() for t in value)


def stage_input(value: Boundary) -> Boundary:
    """A received input becomes a leaf of this stage's graph; its gradient is sent back."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(True)
    return tuple(t.detach().requires_grad_(True) if carries_grad(t) else t.detach() for t in value)


def backward_pairs(outputs: Boundary, grads: Boundary) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The (output, gradient) pairs a chunk's backward starts from: the floating-point members of
    a tuple line up with the received gradients; members outside the graph are skipped."""
    if isinstance(outputs, torch.Tensor):
        return [outputs], [grads]
    floats = [t for t in outputs if carries_grad(t)]
    pairs = [(t, g) for t, g in zip(floats, tensors(grads)) if t.requires_grad]
    return [t for t, _ in pairs], [g for _, g in pairs]


def input_grads(inputs: Boundary) -> Boundary:
    """The gradient to send back for a stage input (zeros for a member the stage did not use)."""
    if isinstance(inputs, torch.Tensor):
        return inputs.grad
    return tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs if carries_grad(t))


def nbytes(value: Boundary) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(value))


def shape_key(value: Boundary) -> tuple:
    """Hashable shape of an input: its shape, or one shape per member of a tuple."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    return tuple(tuple(t.shape) for t in value)


def dtypes(value: Boundary) -> torch.dtype | tuple[torch.dtype, ...]:
    if isinstance(value, torch.Tensor):
        return value.dtype
    return tuple(t.dtype for t in value)


def meta_value(key: tuple, dtype: torch.dtype | tuple[torch.dtype, ...]) -> Boundary:
    """Meta tensors of the shapes ``shape_key`` gave and the dtypes ``dtypes`` gave."""
    if isinstance(dtype, torch.dtype):
        return torch.empty(key, dtype=dtype, device="meta")
    return tuple(torch.empty(shape, dtype=d, device="meta") for shape, d in zip(key, dtype))


def to_device(value: Boundary, device: torch.device) -> Boundary:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    return tuple(t.to(device, non_blocking=True) for t in value)


@dataclass(frozen=True)
class TupleSpec:
    """(shape, dtype) of each member of a tuple crossing a boundary; it travels packed."""

    members: tuple[TensorSpec, ...]

    def grads(self) -> TupleSpec:
        """What travels back: the floating-point members."""
        return TupleSpec(tuple(m for m in self.members if m[1].is_floating_point or m[1].is_complex))

    def packed_bytes(self, parts: int) -> int:
        used = sum(_padded(math.prod(shape) * dtype.itemsize) for shape, dtype in self.members)
        return max(1, math.ceil(used / (ALIGN * parts))) * ALIGN * parts

    def unpack(self, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out, offset = [], 0
        for shape, dtype in self.members:
            size = math.prod(shape) * dtype.itemsize
            out.append(buffer[offset:offset + size].view(dtype).view(shape))
            offset += _padded(size)
        return tuple(out)


Spec = Union[TensorSpec, TupleSpec]


def spec_of(value: Boundary) -> Spec:
    if isinstance(value, torch.Tensor):
        return value.shape, value.dtype
    return TupleSpec(tuple((t.shape, t.dtype) for t in value))


def grad_spec(spec: Spec) -> Spec:
    return spec.grads() if isinstance(spec, TupleSpec) else spec


def pack(value: tuple[torch.Tensor, ...], parts: int) -> torch.Tensor:
    """One uint8 buffer holding every member (``TupleSpec.unpack`` reverses it)."""
    spec = spec_of(value)
    buffer = torch.zeros(spec.packed_bytes(parts), dtype=torch.uint8, device=value[0].device if value else "cpu")
    offset = 0
    for t in value:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset:offset + raw.numel()] = raw
        offset += _padded(raw.numel())
    return buffer


def _padded(size: int) -> int:
    return -(-size // ALIGN) * ALIGN
