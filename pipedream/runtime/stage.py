"""The layers one rank owns (one chunk per virtual stage it holds), and what each in-flight
micro-batch keeps between its forward and its backward."""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from models import boundary
from models.boundary import Boundary, call_layer
from models.grad_accumulation import WeightGradQueue
from models.spec import PipelineSequential
from pipedream.errors import InvariantError
from pipedream.runtime.weight_split import WeightHalf, input_half, parameter_nodes


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

    def __init__(self, parameter_ptrs: Callable[[], set[int]]):
        # asked once the forward is done: zero3 allocates a parameter's storage at its layer's gather
        self.parameter_ptrs = parameter_ptrs
        self.seen: dict[int, int] = {}   # storage pointer -> bytes

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        ptr = tensor.untyped_storage().data_ptr() if tensor.device.type != "meta" else id(tensor)
        if ptr not in self.seen and isinstance(tensor, nn.Parameter):   # fully sharded zero3 frees it before `total`
            self.seen[ptr] = 0
        elif ptr not in self.seen:
            self.seen[ptr] = tensor.untyped_storage().nbytes() if tensor.device.type != "meta" else 0
        return tensor

    @property
    def total(self) -> int:
        parameters = self.parameter_ptrs()
        return sum(nbytes for ptr, nbytes in self.seen.items() if ptr not in parameters)


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _counting(counter: _SavedBytesCounter | None) -> AbstractContextManager:
    """Counts the tensors autograd saves while the context is open, unless ``counter`` is None."""
    if counter is None:
        return nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(counter.pack, _same)


class Stage:
    """Runs forward and backward of this rank's chunks, one micro-batch at a time.

    Stage inputs and outputs are kept per in-flight (micro-batch, chunk) and dropped as soon as
    its backward ends. ``recompute`` keeps only each layer's input and recomputes the layer's
    forward inside its backward (torch.utils.checkpoint restores the RNG state so dropout matches);
    with ``recompute_layers`` = k only the chunk's first k layers are recomputed and the others
    keep their activations.
    ``weights`` (asynchronous schedules) runs the chunk on one weight version instead of its
    parameters; autograd then accumulates gradients on that version (see ``weights.py``).
    ``weight_grads`` holds the weight-gradient GEMMs of the chunks' Linear layers (when they are
    ``AccumulatingLinear``) that a deferred backward leaves for later (``grad_accumulation.py``).
    A split backward (the B of a list with WEIGHT actions, ``ScheduleInfo.split_backward``) of a
    chunk with other weight matrices (a stock module's attention or convolution, any Linear when the
    fused one is off) leaves their gradients to its W too (``weight_split.py``); on a first chunk,
    which sends no input gradient, its B does nothing and its W runs the whole backward.
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
        self.split_graphs = True   # train.split_weight_graphs: a split backward splits stock layers' graphs too
        self.stats = StashStats()
        self.weight_grads = WeightGradQueue()
        self._awaiting_weight: dict[tuple[int, int], int] = {}   # split backwards -> bytes held until W
        self._saved_bytes: dict[tuple, int] = {}   # (chunk, input shapes, dtypes, own weights) -> bytes
        # (microbatch, chunk) -> what its W runs besides the held GEMMs: the weight half of a split
        # graph, or a first chunk's whole backward (its stash entry and output gradient)
        self._weight_halves: dict[tuple[int, int], WeightHalf | tuple[_Stashed, Boundary | None]] = {}
        self._split_params: dict[int, tuple[list[nn.Parameter], list[nn.Parameter]] | None] = {}
        # the model's ``LayerModel.statistics``: told each forward's loss scale, which the gradients
        # of its layers' auxiliary losses (MoE load balancing) are multiplied by on every stage
        self.statistics = None

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
        if self.statistics is not None:
            self.statistics.loss_scale = loss_scale
        # The bytes saved for backward depend on the graph only, which the chunk, its input's shapes
        # and dtypes and the weight source fix: they are counted once per such key (the counting
        # hooks cost a Python call per saved tensor, which small layers notice).
        key = (chunk, boundary.shape_key(inputs), boundary.dtypes(inputs), weights is None)
        nbytes = self._saved_bytes.get(key)
        counter = None if nbytes is not None else self._counter(weights)
        with _counting(counter):
            kept: list[Boundary] = []
            if self.recompute:
                outputs, kept = self._recomputed(chunk, inputs, weights)
            elif weights is not None:
                outputs = self._run_chunk(chunk, inputs, weights)
            else:   # the layers are called here, not through the chunk's forward (docs/design.md, the call path)
                outputs = inputs
                with self.autocast():
                    for layer in self._layers(chunk):   # a tuple is unpacked into the next layer's arguments
                        outputs = layer(*outputs) if isinstance(outputs, tuple) else layer(outputs)
            loss = self.loss_fn(outputs, target) if self.is_last[chunk] else None
            root = outputs if loss is None else loss * loss_scale   # where the backward starts
        if counter is not None:
            held = [inputs, root, *kept]   # the stash and the checkpoints hold these (each storage counted once)
            for tensor in (t for value in held for t in boundary.tensors(value)):
                counter.pack(tensor)
            nbytes = self._saved_bytes[key] = counter.total
        self.stash[(microbatch, chunk)] = _Stashed(inputs, root, nbytes)
        self.stats.add(chunk, nbytes)
        return loss.detach() if loss is not None else boundary.detach(outputs)

    def _layers(self, chunk: int) -> Iterable[nn.Module]:
        """The layers of ``chunk`` in order; a chunk other than a ``PipelineSequential`` is one layer."""
        module = self.chunks[chunk]
        return module if isinstance(module, PipelineSequential) else (module,)

    def _recomputed(self, chunk: int, inputs: Boundary, weights: dict[str, torch.Tensor] | None
                    ) -> tuple[Boundary, list[Boundary]]:
        """Each recomputed layer under its own checkpoint, which keeps only its input (full
        recomputation as the planner prices it: the recomputation inside a layer's backward
        rebuilds one layer's activations, and fully sharded zero3 gathers one layer for it); with
        ``recompute_layers`` = k only the chunk's first k layers, the others keep their activations.
        A chunk run on a weight version (asynchronous schedules) is one checkpoint: its weights are
        the chunk's, not its layers'. Returns the outputs and the layer inputs the checkpoints keep."""
        if weights is not None:
            if self.recompute_layers is not None:
                raise InvariantError("recompute.num_layers with weight versions: the config check refuses it")
            return checkpoint(self._run_chunk, chunk, inputs, weights, use_reentrant=False), [inputs]
        layers = list(self._layers(chunk))
        k = len(layers) if self.recompute_layers is None else min(self.recompute_layers, len(layers))
        value, kept = inputs, []
        with self.autocast():
            for index, layer in enumerate(layers):
                if index < k:
                    kept.append(value)
                    value = checkpoint(call_layer, layer, value, use_reentrant=False)
                else:
                    value = call_layer(layer, value)
        return value, kept

    def _counter(self, weights: dict[str, torch.Tensor] | None) -> _SavedBytesCounter:
        def weight_ptrs() -> set[int]:   # zero3 frees and reallocates the parameters' storage
            ptrs = {p.untyped_storage().data_ptr() for c in self.chunks for p in c.parameters()}
            return ptrs | {t.untyped_storage().data_ptr() for t in (weights or {}).values()}
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
        (microbatch, chunk), for the caller to run. ``split`` (a B followed by its own W) defers
        them too and keeps the micro-batch in flight until ``weight_grad`` (its W) runs them."""
        stashed = self.stash.pop((microbatch, chunk))
        if split and self.split_graphs and self._splits_graph(chunk):
            self._split_backward(microbatch, chunk, stashed, grad_output)
        elif defer_weight_grads or split:
            with self.weight_grads.deferred((microbatch, chunk)):
                self._backpropagate(chunk, stashed, grad_output)
        else:
            self._backpropagate(chunk, stashed, grad_output)
        if split:
            self._awaiting_weight[(microbatch, chunk)] = stashed.saved_bytes
        else:
            self.stats.remove(stashed.saved_bytes)
        return None if self.is_first[chunk] else boundary.input_grads(stashed.inputs)

    def _splits_graph(self, chunk: int) -> bool:
        """Whether a split backward of ``chunk`` splits its graph (``weight_split``): it has weight
        matrices that no fused layer holds back (embedding tables excluded: their gradient is a
        scatter, not a GEMM) and no recomputation (which the weight half would repeat)."""
        if chunk not in self._split_params:
            fused = {id(p) for m in self.chunks[chunk].modules() if getattr(m, "fused_weight_grads", False)
                     for p in m.parameters(recurse=False)}
            embedded = {id(p) for m in self.chunks[chunk].modules() if isinstance(m, nn.Embedding)
                        for p in m.parameters(recurse=False)}
            params = [p for p in self.chunks[chunk].parameters() if p.requires_grad]
            split = [p for p in params if id(p) not in fused]
            wanted = not self.recompute and any(p.dim() >= 2 and id(p) not in embedded for p in split)
            self._split_params[chunk] = (split, [p for p in params if id(p) in fused]) if wanted else None
        return self._split_params[chunk] is not None

    def _split_backward(self, microbatch: int, chunk: int, stashed: _Stashed, grad_output: Boundary | None) -> None:
        """B of a chunk whose graph splits: the input gradient now (and the fused layers' backward,
        their GEMMs held as usual), the other weights' gradients in ``weight_grad``."""
        key = (microbatch, chunk)
        if self.is_first[chunk]:
            self._weight_halves[key] = (stashed, grad_output)
            return
        split, fused = self._split_params[chunk]
        outputs, grads = self._roots(chunk, stashed, grad_output)
        leaves = [t for t in boundary.tensors(stashed.inputs) if t.requires_grad]
        with self.weight_grads.deferred(key):
            half = input_half(outputs, grads, leaves, parameter_nodes(split), parameter_nodes(fused),
                              self.weight_grads.after_accumulate) if outputs else None
            if half is None:   # a graph the split does not handle: all of it now, and from now on
                self._split_params[chunk] = None   # (the chunk's graph has the same shape every time)
                self._backpropagate(chunk, stashed, grad_output)
        if half is not None:
            self._weight_halves[key] = half

    def _roots(self, chunk: int, stashed: _Stashed, grad_output: Boundary | None
               ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """The tensors a chunk's backward starts from, and their gradients."""
        if self.is_last[chunk]:
            return [stashed.outputs], [None]
        if isinstance(stashed.outputs, torch.Tensor):
            return [stashed.outputs], [grad_output]
        return boundary.backward_pairs(stashed.outputs, grad_output)

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
        """A WEIGHT action (``ScheduleInfo.split_backward``): the weight-gradient GEMMs that the split
        backward of (microbatch, chunk) left, then its activations count as freed."""
        self.weight_grads.run((microbatch, chunk))
        rest = self._weight_halves.pop((microbatch, chunk), None)
        if isinstance(rest, WeightHalf):
            rest.run()
        elif rest is not None:   # a first chunk's whole backward
            self._backpropagate(chunk, *rest)
        self.stats.remove(self._awaiting_weight.pop((microbatch, chunk)))

    def forward_only(self, chunk: int, inputs: Boundary, target: Boundary | None = None) -> Boundary:
        """Evaluation: no graph, nothing stashed."""
        with torch.no_grad():
            with self.autocast():
                outputs = self.chunks[chunk](inputs)
            return self.loss_fn(outputs, target) if self.is_last[chunk] else outputs


