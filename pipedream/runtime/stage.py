"""The layers one rank owns (one chunk, or v chunks when interleaved), and what each in-flight
micro-batch keeps between its forward and its backward."""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from itertools import islice
from typing import Callable

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from models import boundary
from models.boundary import Boundary, call_layer
from models.grad_accumulation import WeightGradQueue
from pipedream.errors import InvariantError


@dataclass
class _Stashed:
    inputs: Boundary
    outputs: Boundary              # the chunk's output, or the scaled loss on the last stage
    saved_bytes: int


@dataclass
class StashStats:
    """Peak number of in-flight (micro-batch, chunk) pairs and the peak bytes they held."""

    in_flight: int = 0
    peak_in_flight: int = 0
    bytes: int = 0
    peak_bytes: int = 0
    bytes_per_microbatch: dict[int, int] = field(default_factory=dict)  # chunk -> bytes of the last one

    def add(self, chunk: int, nbytes: int) -> None:
        self.in_flight += 1
        self.bytes += nbytes
        self.bytes_per_microbatch[chunk] = nbytes
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def remove(self, nbytes: int) -> None:
        self.in_flight -= 1
        self.bytes -= nbytes


class _SavedBytesCounter:
    """Counts the bytes autograd saves for backward, parameters excluded (a tensor saved twice
    counts once)."""

    def __init__(self, parameter_ptrs: set[int]):
        self.parameter_ptrs = parameter_ptrs
        self.seen: set[int] = set()
        self.total = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        ptr = tensor.untyped_storage().data_ptr() if tensor.device.type != "meta" else id(tensor)
        if ptr not in self.parameter_ptrs and ptr not in self.seen:
            self.seen.add(ptr)
            self.total += tensor.untyped_storage().nbytes() if tensor.device.type != "meta" else 0
        return tensor


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class Stage:
    """Runs forward and backward of this rank's chunks, one micro-batch at a time.

    Stage inputs and outputs are kept per in-flight (micro-batch, chunk) and dropped as soon as
    its backward ends. ``recompute`` keeps only the chunk's input and recomputes the forward
    inside the backward (torch.utils.checkpoint restores the RNG state so dropout matches);
    with ``recompute_layers`` = k only the chunk's first k layers are recomputed (one checkpoint
    around them) and the others keep their activations.
    ``weights`` (asynchronous schedules) runs the chunk on one weight version instead of its
    parameters; autograd then accumulates gradients on that version (see ``weights.py``).
    ``weight_grads`` holds the weight-gradient GEMMs of the chunks' Linear layers (when they are
    ``AccumulatingLinear``) that a deferred backward leaves for later (``grad_accumulation.py``).
    """

    def __init__(self, chunks: list[nn.Module], is_first: list[bool], is_last: list[bool],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], recompute: bool = False,
                 autocast: Callable[[], AbstractContextManager] = nullcontext, recompute_layers: int | None = None):
        self.chunks = chunks
        self.autocast = autocast   # mixed precision: the context every chunk forward runs in
        self.is_first = is_first
        self.is_last = is_last
        self.loss_fn = loss_fn
        self.recompute = recompute
        self.recompute_layers = recompute_layers
        self.stash: dict[tuple[int, int], _Stashed] = {}
        self.stats = StashStats()
        self.weight_grads = WeightGradQueue()
        self._awaiting_weight: dict[tuple[int, int], int] = {}   # split backwards -> bytes held until W
        self._saved_bytes: dict[tuple, int] = {}   # (chunk, input shapes, dtypes, own weights) -> bytes
        self._parameter_ptrs = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}

    def parameters(self) -> list[nn.Parameter]:
        seen, params = set(), []
        for chunk in self.chunks:
            for p in chunk.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params

    def forward(self, microbatch: int, chunk: int, inputs: Boundary, target: Boundary | None = None,
                loss_scale: float = 1.0, weights: dict[str, torch.Tensor] | None = None) -> Boundary:
        """Runs the chunk; returns its output (to send on) or, on the last stage, the unscaled loss.
        Inputs and outputs are a tensor or a tuple of tensors (``boundary``)."""
        if not self.is_first[chunk]:
            inputs = boundary.stage_input(inputs)
        # The bytes saved for backward depend on the graph only, which the chunk, its input's shapes
        # and dtypes and the weight source fix: they are counted once per such key (the counting
        # hooks cost a Python call per saved tensor, which small layers notice).
        key = (chunk, boundary.shape_key(inputs), boundary.dtypes(inputs), weights is None)
        nbytes = self._saved_bytes.get(key)
        counter = None if nbytes is not None else self._counter(weights)
        if counter is None:
            loss, outputs = self._forward_graph(chunk, inputs, target, loss_scale, weights)
        else:
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, _same):
                loss, outputs = self._forward_graph(chunk, inputs, target, loss_scale, weights)
            for held in (*boundary.tensors(inputs), *boundary.tensors(outputs)):
                counter.pack(held)   # the stash holds the inputs and outputs too (each storage counted once)
            nbytes = self._saved_bytes[key] = counter.total
        self.stash[(microbatch, chunk)] = _Stashed(inputs, outputs, nbytes)
        self.stats.add(chunk, nbytes)
        return loss.detach() if self.is_last[chunk] else boundary.detach(outputs)

    def _forward_graph(self, chunk: int, inputs: Boundary, target: Boundary | None, loss_scale: float,
                       weights: dict[str, torch.Tensor] | None) -> tuple[torch.Tensor | None, Boundary]:
        """(the unscaled loss or None, what the backward starts from: the output or the scaled loss)."""
        if self.recompute:
            outputs = self._recomputed(chunk, inputs, weights)
        else:
            outputs = self._run_chunk(chunk, inputs, weights)
        if not self.is_last[chunk]:
            return None, outputs
        loss = self.loss_fn(outputs, target)
        return loss, loss * loss_scale

    def _recomputed(self, chunk: int, inputs: Boundary, weights: dict[str, torch.Tensor] | None) -> Boundary:
        """The whole chunk under one checkpoint, or its first ``recompute_layers`` under one and the
        rest as usual (the flush schedules only: their chunks run on their own parameters)."""
        k = self.recompute_layers
        if k is None or k >= len(self.chunks[chunk]):
            return checkpoint(self._run_chunk, chunk, inputs, weights, use_reentrant=False)
        if weights is not None:
            raise InvariantError("recompute.num_layers with weight versions: the config check refuses it")
        if k == 0:
            return self._run_chunk(chunk, inputs, None)
        head = checkpoint(self._run_layers, chunk, 0, k, inputs, use_reentrant=False)
        return self._run_layers(chunk, k, len(self.chunks[chunk]), head)

    def _run_layers(self, chunk: int, start: int, end: int, value: Boundary) -> Boundary:
        with self.autocast():
            for layer in islice(self.chunks[chunk], start, end):
                value = call_layer(layer, value)
        return value

    def _counter(self, weights: dict[str, torch.Tensor] | None) -> _SavedBytesCounter:
        weight_ptrs = self._parameter_ptrs
        if weights is not None:
            weight_ptrs = weight_ptrs | {t.untyped_storage().data_ptr() for t in weights.values()}
        return _SavedBytesCounter(weight_ptrs)

    def _run_chunk(self, chunk: int, inputs: Boundary, weights: dict[str, torch.Tensor] | None) -> Boundary:
        if self.autocast is nullcontext and weights is None:   # fp32: no context to enter
            return self.chunks[chunk](inputs)
        with self.autocast():
            if weights is None:
                return self.chunks[chunk](inputs)
            return functional_call(self.chunks[chunk], weights, (inputs,))

    def backward(self, microbatch: int, chunk: int, grad_output: Boundary | None = None,
                 defer_weight_grads: bool = False, split: bool = False) -> Boundary | None:
        """Backpropagates through the chunk; returns the gradient of its input (None on the first).
        ``defer_weight_grads`` leaves the Linear weight gradients in ``weight_grads``, as the group
        (microbatch, chunk), for the caller to run. ``split`` (a zero-bubble schedule's B) defers
        them too and keeps the micro-batch in flight until ``weight_grad`` (its W) runs them."""
        stashed = self.stash.pop((microbatch, chunk))
        if defer_weight_grads or split:
            with self.weight_grads.deferred((microbatch, chunk)):
                self._backpropagate(chunk, stashed, grad_output)
        else:
            self._backpropagate(chunk, stashed, grad_output)
        if split:
            self._awaiting_weight[(microbatch, chunk)] = stashed.saved_bytes
        else:
            self.stats.remove(stashed.saved_bytes)
        return None if self.is_first[chunk] else boundary.input_grads(stashed.inputs)

    def _backpropagate(self, chunk: int, stashed: _Stashed, grad_output: Boundary | None) -> None:
        if self.is_last[chunk]:
            stashed.outputs.backward()
        elif isinstance(stashed.outputs, torch.Tensor):   # one tensor crossed: no pairing to do
            torch.autograd.backward(stashed.outputs, grad_output)
        else:
            outputs, grads = boundary.backward_pairs(stashed.outputs, grad_output)
            if outputs:
                torch.autograd.backward(outputs, grads)

    def weight_grad(self, microbatch: int, chunk: int) -> None:
        """A zero-bubble schedule's W: the weight-gradient GEMMs that the split backward of
        (microbatch, chunk) left, then its activations count as freed."""
        self.weight_grads.run((microbatch, chunk))
        self.stats.remove(self._awaiting_weight.pop((microbatch, chunk)))

    def forward_only(self, chunk: int, inputs: Boundary, target: Boundary | None = None) -> Boundary:
        """Evaluation: no graph, nothing stashed."""
        with torch.no_grad():
            with self.autocast():
                outputs = self.chunks[chunk](inputs)
            return self.loss_fn(outputs, target) if self.is_last[chunk] else outputs


