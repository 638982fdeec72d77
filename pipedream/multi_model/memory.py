"""Runs each fused group's forward under its feature-map decision, with every byte it holds
counted in a device tier (``pipedream.offload.DeviceTier``: resident bytes, peak, budget refusal).

KEEP: the saved tensors stay, counted from the forward until the group's backward ends. SWAP:
each saved tensor is copied to the host tier in the forward and copied back when the backward
of the next node starts (``BackwardStart`` of that node), or on demand. RECOMPUTE: nothing is
saved; the backward runs the group's forward again (RNG restored) and backpropagates through it.
A group's bytes are released when gradients reach its inputs and stacked weights
(``BackwardEnd``), and whatever a backward left is released at the end of the step.
"""
from __future__ import annotations

import itertools
import weakref
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from pipedream.offload import DeviceTier, Direction, TensorClass

from pipedream.multi_model.feature_plan import Decision

ACTIVATIONS = TensorClass.ACTIVATIONS


@dataclass
class GroupCall:
    """One fused group's forward of one micro-batch."""

    id: int
    layer: int
    group: int
    decision: Decision
    counted: list[Any] = field(default_factory=list)     # keys held in the device tier
    swapped: list[Any] = field(default_factory=list)     # keys held in the host tier
    views: dict[tuple, Any] = field(default_factory=dict)   # view -> (key, weak reference to the tensor)
    nbytes: int = 0                                       # feature-map bytes its forward saved
    saved: int = 0                                        # tensors held so far (numbers their keys)
    started_s: float = 0.0
    forward_s: float = 0.0


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _view(tensor: torch.Tensor) -> tuple:
    return (_storage(tensor), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


class _BackwardStart(torch.autograd.Function):
    """Identity on a group's outputs: its backward runs first in the group's backward."""

    @staticmethod
    def forward(ctx, callback: Callable[[], None], *outputs: torch.Tensor):
        ctx.callback = callback
        return tuple(o.view_as(o) for o in outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.callback()
        return (None, *grads)


class _BackwardEnd(_BackwardStart):
    """Identity on a group's inputs and stacked weights: its backward runs once they have their
    gradients, i.e. after the group's backward."""


class _Recompute(torch.autograd.Function):
    """The group's forward without saving anything; the backward recomputes and backpropagates."""

    @staticmethod
    def forward(ctx, manager: "FeatureMapMemory", call: GroupCall, run: Callable[..., Any], count: int,
                *tensors: torch.Tensor):
        ctx.manager, ctx.call, ctx.run, ctx.count = manager, call, run, count
        ctx.device = tensors[0].device
        ctx.rng = torch.get_rng_state()   # dropout draws the same masks again (as torch.utils.checkpoint)
        ctx.device_rng = torch.cuda.get_rng_state(ctx.device) if ctx.device.type == "cuda" else None
        ctx.save_for_backward(*tensors[:count])
        ctx.parameters = len(tensors) - count
        with torch.no_grad():
            return run(*tensors[:count])

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors[:ctx.count]]
        devices = [ctx.device] if ctx.device_rng is not None else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), ctx.manager.hooks(ctx.call, Decision.KEEP):
            torch.set_rng_state(ctx.rng)
            if ctx.device_rng is not None:
                torch.cuda.set_rng_state(ctx.device_rng, ctx.device)
            outputs = ctx.run(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        ctx.manager.release(ctx.call)
        input_grads = [t.grad if t.requires_grad else None for t in inputs]
        return (None, None, None, None, *input_grads, *([None] * ctx.parameters))


class FeatureMapMemory:
    """One rank's fused groups under their decisions, counted in ``tier``."""

    def __init__(self, tier: DeviceTier, decisions: dict[tuple[int, int], Decision] | None = None,
                 parameters: list[torch.nn.Parameter] = ()):
        self.tier = tier
        self.decisions = decisions or {}          # (layer, group) -> decision; absent: keep
        self._ids = itertools.count()
        self._previous: GroupCall | None = None
        self._open: dict[int, GroupCall] = {}     # calls whose bytes are still held
        self.profile: list[GroupCall] | None = None
        self._param_storages = {_storage(p) for p in parameters}
        for index, param in enumerate(parameters):
            tier.adopt(("weights", index), param.detach(), TensorClass.WEIGHTS)

    # --- saved tensors ---------------------------------------------------------------------
    def hooks(self, call: GroupCall, decision: Decision) -> torch.autograd.graph.saved_tensors_hooks:
        def pack(tensor: torch.Tensor) -> Any:
            if tensor.device.type == "meta" or _storage(tensor) in self._param_storages:
                return ("as is", tensor)
            # a tensor saved twice is held once; a swapped tensor's memory may be reused by a
            # later one (same address), so only a still-living tensor matches
            view = _view(tensor)
            held, alive = call.views.get(view, (None, None))
            if held is None or alive() is not tensor:
                held = (call.id, call.saved)
                call.saved += 1
                call.views[view] = (held, weakref.ref(tensor))
                call.nbytes += tensor.nbytes
                if decision is Decision.SWAP:
                    self.tier.host.put(held, tensor)
                    self.tier.counters.add(ACTIVATIONS, Direction.DEVICE_TO_HOST, tensor.nbytes)
                    call.swapped.append(held)
                else:
                    self.tier.adopt(held, tensor.detach(), ACTIVATIONS)
                    call.counted.append(held)
            return ("swapped", held) if decision is Decision.SWAP else ("as is", tensor)

        def unpack(packed: Any) -> torch.Tensor:
            kind, value = packed
            if kind == "as is":
                return value
            if value not in self.tier:
                self.tier.swap_in(value, ACTIVATIONS)
                call.counted.append(value)
            return self.tier.get(value)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def prefetch(self, call: GroupCall) -> None:
        for key in call.swapped:
            if key not in self.tier and self.tier.prefetch(key, ACTIVATIONS):
                call.counted.append(key)

    def release(self, call: GroupCall) -> None:
        for key in call.counted:
            if key in self.tier:
                self.tier.release(key)
        for key in call.swapped:
            self.tier.host.remove(key)
        call.counted, call.swapped = [], []
        self._open.pop(call.id, None)

    def end_step(self) -> None:
        """Releases what a backward left (a group with no gradient path to mark its end)."""
        for call in list(self._open.values()):
            self.release(call)
        self._previous = None

    # --- a group's forward -----------------------------------------------------------------
    def run(self, layer: int, group: int, run: Callable[..., Any], build_state: Callable[[], dict[str, torch.Tensor]],
            inputs: tuple, parameters: list[torch.Tensor]) -> Any:
        """``run(build_state(), *inputs)`` under this group's decision; ``parameters`` are the
        per-model leaves the state is stacked from (a recomputed group stacks them again)."""
        decision = self.decisions.get((layer, group), Decision.KEEP) if torch.is_grad_enabled() else None
        if decision is None:
            return run(build_state(), *inputs)
        call = GroupCall(next(self._ids), layer, group, decision, started_s=time.perf_counter())
        previous = self._previous if self._follows(self._previous, layer, group) else None
        self._previous = call
        self._open[call.id] = call
        if decision is Decision.RECOMPUTE:   # released at the end of its own backward
            outputs = _Recompute.apply(self, call, lambda *xs: run(build_state(), *xs), len(inputs), *inputs,
                                       *parameters)
        else:
            state = build_state()
            marked = [t for t in (*state.values(), *inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
            if marked:
                ends = iter(_BackwardEnd.apply(lambda: self.release(call), *marked))
                replaced = {id(t): next(ends) for t in marked}
                state = {k: replaced.get(id(v), v) for k, v in state.items()}
                inputs = tuple(replaced.get(id(x), x) if isinstance(x, torch.Tensor) else x for x in inputs)
            with self.hooks(call, decision):
                outputs = run(state, *inputs)
        call.forward_s = time.perf_counter() - call.started_s
        if self.profile is not None:
            self.profile.append(call)
        return self._mark_start(outputs, previous)

    def _mark_start(self, outputs: Any, previous: GroupCall | None) -> Any:
        """When this group's backward starts, the previous node's swapped maps are fetched back."""
        if previous is None or not previous.swapped:
            return outputs
        single = not isinstance(outputs, tuple)
        members = (outputs,) if single else outputs
        floats = [o for o in members if o.requires_grad]
        if not floats:
            return outputs
        marked = iter(_BackwardStart.apply(lambda: self.prefetch(previous), *floats))
        result = tuple(next(marked) if o.requires_grad else o for o in members)
        return result[0] if single else result

    @staticmethod
    def _follows(previous: GroupCall | None, layer: int, group: int) -> bool:
        """The previous call belongs to the same chunk forward (the layer order continues)."""
        return previous is not None and layer in (previous.layer, previous.layer + 1) and \
            (previous.layer, previous.group) < (layer, group)
