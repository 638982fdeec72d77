"""Linear layers whose weight gradient accumulates inside the GEMM that computes it.

Plain autograd computes each micro-batch's weight gradient dY^T X into a new tensor and then adds
it to ``weight.grad`` (AccumulateGrad): per micro-batch and Linear, one weight-sized tensor is
written, read back and added. ``weight.grad.addmm_(dY^T, X)`` does the same sum in one pass (as
Megatron-LM's gradient-accumulation fusion). Gradients equal autograd's up to float rounding; what
changes is memory traffic, which is what a pipeline stage's backward is bound by when every core
is busy (docs/benchmarks.md).

``fuse_grad_accumulation(module, queue)`` switches every ``nn.Linear`` inside ``module`` to
``AccumulatingLinear`` in place: same parameters, names and state dict, same forward. With a
``WeightGradQueue``, a backward run inside ``queue.deferred(key)`` computes input gradients only
and leaves its weight-gradient GEMMs in the queue as one group: a pipeline stage sends its input
gradient first, so the previous stage starts its backward earlier, and runs the group later
(``run_oldest``). Groups run in the order they were queued, so every weight gradient is summed
over micro-batches in the same order whenever the groups run: results do not depend on when.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Hashable

import torch
import torch.nn.functional as F
from torch import nn


def accumulate_weight_grad(weight: torch.Tensor, grad_output: torch.Tensor, inputs: torch.Tensor) -> None:
    """``weight.grad += grad_output^T @ inputs`` over all leading dimensions, in one GEMM."""
    flat_grad = grad_output.reshape(-1, grad_output.shape[-1])
    flat_inputs = inputs.reshape(-1, inputs.shape[-1])
    if flat_inputs.dtype != flat_grad.dtype:   # skip the no-op call: one fewer per held GEMM
        flat_inputs = flat_inputs.to(flat_grad.dtype)
    if weight.grad is None:
        weight.grad = flat_grad.t().mm(flat_inputs).to(weight.dtype)
    elif weight.grad.dtype == flat_grad.dtype:
        weight.grad.addmm_(flat_grad.t(), flat_inputs)
    else:   # e.g. bf16 activations with fp32 gradients: accumulate in the gradient's precision
        weight.grad.add_(flat_grad.t().mm(flat_inputs).to(weight.grad.dtype))


class WeightGradQueue:
    """Weight-gradient GEMMs held back while ``deferred(key)`` is active: one group per key (a
    backward), run oldest first."""

    def __init__(self) -> None:
        # called with each weight whose gradient a GEMM has just added to (autograd's
        # post-accumulate hooks do not see these): the data-parallel reduction counts them
        self.after_accumulate: Callable[[torch.Tensor], None] | None = None
        self._collecting: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        self._key: Hashable = None
        self._groups: deque[tuple[Hashable, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]] = deque()

    def deferred(self, key: Hashable) -> WeightGradQueue:
        """``with queue.deferred(key):`` holds the GEMMs of the backward inside as the group ``key``
        (the queue is its own context: a generator-based one costs a few Python calls per backward)."""
        self._key = key
        return self

    def __enter__(self) -> None:
        self._collecting = []

    def __exit__(self, *exc_info: object) -> None:
        gemms, self._collecting = self._collecting, None
        if gemms:
            self._groups.append((self._key, gemms))

    def accumulate(self, weight: torch.Tensor, grad_output: torch.Tensor, inputs: torch.Tensor) -> None:
        if self._collecting is not None:
            self._collecting.append((weight, grad_output, inputs))
        else:
            self.accumulate_now(weight, grad_output, inputs)

    def __len__(self) -> int:
        """Groups waiting to run."""
        return len(self._groups)

    def run(self, key: Hashable) -> bool:
        """Runs the group of ``key`` (a WEIGHT action of a zero-bubble schedule); False when that
        backward left none (no fused Linear in the chunk)."""
        for index, (held, gemms) in enumerate(self._groups):
            if held == key:
                del self._groups[index]
                self._run_group(gemms)
                return True
        return False

    def run_oldest(self) -> Hashable:
        """Runs the oldest group's GEMMs; returns its key."""
        key, gemms = self._groups.popleft()
        self._run_group(gemms)
        return key

    def _run_group(self, gemms: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        # outside autograd's backward grad mode is on, and the held inputs may require grad: recorded,
        # the GEMMs would give .grad a graph holding every micro-batch's inputs until the step ends
        with torch.no_grad():
            for weight, grad_output, inputs in gemms:
                self.accumulate_now(weight, grad_output, inputs)

    def accumulate_now(self, weight: torch.Tensor, grad_output: torch.Tensor, inputs: torch.Tensor) -> None:
        """Accumulates at once, never held back (and tells ``after_accumulate``)."""
        accumulate_weight_grad(weight, grad_output, inputs)
        if self.after_accumulate is not None:
            self.after_accumulate(weight)


class _LinearAccumulatingGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                queue: WeightGradQueue | None) -> torch.Tensor:
        # the weight itself, not a saved copy: its .grad is where the gradient goes (a saved leaf
        # comes back from saved_tensors_hooks as another tensor object)
        ctx.save_for_backward(inputs)
        ctx.weight, ctx.has_bias, ctx.queue = weight, bias is not None, queue
        return F.linear(inputs, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (inputs,), weight = ctx.saved_tensors, ctx.weight
        grad_inputs = grad_bias = None
        if ctx.needs_input_grad[0]:
            if weight.dtype == grad_output.dtype == inputs.dtype:   # fp32: no casts, two fewer calls
                grad_inputs = grad_output.matmul(weight)
            else:
                grad_inputs = grad_output.matmul(weight.to(grad_output.dtype)).to(inputs.dtype)
        if ctx.needs_input_grad[1]:
            # the weight is a leaf (a parameter, or a weight version of an asynchronous schedule):
            # its gradient lands directly in .grad, so autograd gets None for it
            if ctx.queue is not None:
                ctx.queue.accumulate(weight, grad_output, inputs)
            else:
                accumulate_weight_grad(weight, grad_output, inputs)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
            if grad_bias.dtype != weight.dtype:   # skip the no-op cast: one fewer call per backward
                grad_bias = grad_bias.to(weight.dtype)
        return grad_inputs, None, grad_bias, None


def _run_backward(ctx, grad_output: torch.Tensor):
    return _LinearAccumulatingGrad.backward(ctx, grad_output)


# autograd calls ``apply`` on the backward node; the inherited one looks the user's backward up on
# every call (``_get_user_fn``, ``boxed_grads_call``); this Function's is fixed, so it goes there
_LinearAccumulatingGrad._backward_cls.apply = _run_backward
# ``Function.apply`` is a Python wrapper (default arguments, functorch's checks and the unwrapping
# of every argument: about a dozen Python calls per Linear) around the C apply, which outside a
# functorch transform is all it calls: it is called directly then. The wrapper's unwrapping is for
# tensors left over from a finished transform; the layers' parameters and inputs are none.
_apply_in_c = super(torch.autograd.function._SingleLevelFunction, _LinearAccumulatingGrad).apply


def accumulating_linear(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        queue: WeightGradQueue | None) -> torch.Tensor:
    """``F.linear`` whose weight gradient accumulates inside its GEMM (through ``queue`` when
    given); plain ``F.linear`` where no leaf gradient is taken (evaluation, a frozen weight)."""
    if not (weight.requires_grad and weight.is_leaf) or not torch.is_grad_enabled():
        return F.linear(inputs, weight, bias)
    if torch._C._are_functorch_transforms_active():   # vmap/grad (fused multi-model layers)
        return _LinearAccumulatingGrad.apply(inputs, weight, bias, queue)
    return _apply_in_c(inputs, weight, bias, queue)


class AccumulatingLinear(nn.Linear):
    """``nn.Linear`` whose weight gradient accumulates in place (see the module docstring)."""

    fused_weight_grads = True
    weight_grads: WeightGradQueue | None = None

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return accumulating_linear(inputs, self.weight, self.bias, self.weight_grads)


def fuse_grad_accumulation(module: nn.Module, queue: WeightGradQueue | None = None) -> int:
    """Switches every plain ``nn.Linear`` in ``module`` to ``AccumulatingLinear``, and turns on
    the same in layers that offer it (``fused_weight_grads``: the tensor-parallel linears), their
    weight gradients going through ``queue`` when given; returns how many layers."""
    count = 0
    for layer in module.modules():
        if type(layer) is nn.Linear:
            layer.__class__ = AccumulatingLinear
        elif not hasattr(layer, "fused_weight_grads"):
            continue
        layer.fused_weight_grads = True
        layer.weight_grads = queue
        count += 1
    return count
