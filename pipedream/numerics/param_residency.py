"""zero3 with ``optim.reshard_after_forward=true``, fully sharded (as FSDP): a layer's parameters
are whole only while its forward or its backward runs, and its gradients only from its backward to
their reduce-scatter, so a rank holds about one layer's whole parameters and gradients besides its
shards.

The optimizer's buckets are the layers (``layer_buckets``). ``ShardedOptimizer.shard_parameters``'
forward pre-hooks gather a layer (and launch the next one's gather); the forward hook here frees it
again and hooks its outputs: when their gradient arrives, the layer's backward is about to run, so
it is gathered (and the previous layer's gather launched). The layer is then open until every
parameter of it has had as many gradients added as its backward was opened (a split backward's W
adds the weights' later, ``grad_accumulation.WeightGradQueue``): its gradients are then
reduce-scattered into the shard (``ShardedOptimizer.reduce_into_shard``) and dropped, and its
parameters freed. A layer that never closes (a parameter without a gradient, one shared by two
layers, a tied copy summed across stages first) keeps both until the SYNC, which reduces what is
left. Every data-parallel replica of a stage runs the same backward, so the collectives match.

A forward inside the backward is a recomputation (``recompute.granularity``): the layers it
gathers stay whole until their backward closes them, since autograd reads the parameters they save.
An evaluation leaves whole the layers it found whole (after ``whole_parameters``: checkpoints, the
end of training) and frees the others.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Iterable

import torch
from torch import nn

from models.grad_accumulation import WeightGradQueue
from pipedream.numerics.sharded_optim import ShardedOptimizer


def layer_buckets(chunks: Iterable[Iterable[nn.Module]], params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """One bucket per layer, in reverse order of use (as ``grad_buckets.assign_buckets``); a
    parameter two layers share goes with the first."""
    wanted, seen, buckets = {id(p) for p in params}, set(), []
    for chunk in chunks:
        for layer in chunk:
            mine = [p for p in layer.parameters() if id(p) in wanted and id(p) not in seen]
            seen.update(id(p) for p in mine)
            if mine:
                buckets.append(mine)
    rest = [p for p in params if id(p) not in seen]   # outside every layer: one bucket of their own
    if rest:
        buckets.append(rest)
    return buckets[::-1]


@dataclass
class _Layer:
    needed: tuple[int, ...]          # its buckets, in forward order
    previous: tuple[int, ...]        # the previous layer's (prefetched at its backward)
    params: tuple[nn.Parameter, ...]   # whose gradients close it
    opened: int = 0                  # backwards begun since it last closed
    kept: bool = False               # an evaluation found it whole (checkpoints, the end): it stays so
    added: dict[int, int] = field(default_factory=dict)   # parameter -> gradients added since


def added_everywhere(params: Iterable[nn.Parameter], added: dict[int, int], opened: int) -> bool:
    """Whether each of ``params`` has had one gradient added per backward opened (and some opened)."""
    return opened > 0 and all(added.get(id(p), 0) == opened for p in params)


class LayerResidency:
    """``held``: parameters whose gradients wait for the SYNC (tied copies); ``queue``: the stage's
    held weight-gradient GEMMs, which report what they add."""

    def __init__(self, optimizer: ShardedOptimizer, chunks: Iterable[Iterable[nn.Module]],
                 held: frozenset[int] = frozenset(), queue: WeightGradQueue | None = None):
        self.optimizer = optimizer
        chunks = [list(chunk) for chunk in chunks]
        bucket_of = {id(p): index for index, bucket in enumerate(optimizer.buckets) for p in bucket.params}
        # the fused Linears' weights: their GEMM reports each gradient (autograd's hook fires too, with none)
        fused = {id(m.weight) for chunk in chunks for layer in chunk for m in layer.modules()
                 if getattr(m, "fused_weight_grads", False) and isinstance(getattr(m, "weight", None), torch.Tensor)}
        self.layers: list[_Layer] = []
        self._of_param: dict[int, list[_Layer]] = {}
        self._handles: list[Any] = []
        for chunk in chunks:
            previous: tuple[int, ...] = ()
            for layer in chunk:
                needed = tuple(sorted({bucket_of[id(p)] for p in layer.parameters() if id(p) in bucket_of},
                                      reverse=True))
                if not needed:
                    continue
                params = tuple(p for p in layer.parameters()
                               if p.requires_grad and id(p) in bucket_of and id(p) not in held)
                state = _Layer(needed, previous, params)
                self.layers.append(state)
                for p in params:
                    self._of_param.setdefault(id(p), []).append(state)
                self._handles.append(layer.register_forward_pre_hook(partial(self._before_forward, state),
                                                                     prepend=True))   # before the gather
                self._handles.append(layer.register_forward_hook(partial(self._after_forward, state)))
                previous = needed
        for p in optimizer.params:
            if id(p) in self._of_param and id(p) not in fused:
                self._handles.append(p.register_post_accumulate_grad_hook(self.accumulated))
        if queue is not None:
            queue.after_accumulate = self.accumulated
        optimizer.after_sync = self.reset

    def _before_forward(self, state: _Layer, module: nn.Module, args: Any) -> None:
        state.kept = not torch.is_grad_enabled() and self.optimizer.whole(state.needed)

    def _after_forward(self, state: _Layer, module: nn.Module, args: Any, outputs: Any) -> None:
        if state.kept or torch._C._current_graph_task_id() != -1:   # a recomputation: its backward
            return                                                   # reads the parameters it saved
        tensors = [t for t in _tensors(outputs) if t.requires_grad and t.grad_fn is not None]
        if tensors:
            token = [False]   # one opening per forward, whichever output's gradient comes first
            for tensor in tensors:
                tensor.register_hook(partial(self._before_backward, state, token))
        self._release(state.needed)

    def _before_backward(self, state: _Layer, token: list[bool], grad: torch.Tensor) -> None:
        if token[0]:
            return
        token[0] = True
        state.opened += 1
        self.optimizer.acquire(state.needed)
        self.optimizer.prefetch(state.previous)

    def accumulated(self, param: torch.Tensor) -> None:
        """A gradient was added to ``param.grad`` (autograd's hook, or a held GEMM's report)."""
        for state in self._of_param.get(id(param), ()):
            state.added[id(param)] = state.added.get(id(param), 0) + 1
            if added_everywhere(state.params, state.added, state.opened):
                self._close(state)

    def _close(self, state: _Layer) -> None:
        state.opened, state.added = 0, {}
        self.optimizer.reduce_into_shard(state.needed, state.params)
        self._release(state.needed)

    def _release(self, indices: tuple[int, ...]) -> None:
        """Frees ``indices`` but those an open layer (its backward begun) still needs."""
        busy = {index for state in self.layers if state.opened for index in state.needed}
        self.optimizer.release(index for index in indices if index not in busy)

    def reset(self) -> None:
        """The SYNC reduced every gradient left: no layer is open."""
        for state in self.layers:
            state.opened, state.added = 0, {}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []
