"""A split backward (``ScheduleInfo.split_backward``: B, then W) for any layers, not only the fused Linear.

The fused layers (``models/grad_accumulation.py``) hold their own weight-gradient GEMMs back. Other
parameters (a stock ``nn.MultiheadAttention``'s projections, a convolution, a LayerNorm) get their
gradient from the autograd node that uses them, and that node also computes the gradient that
flows on towards the stage input. The split walks the chunk's graph once per backward:

- the *input path*: the nodes between the chunk's outputs and its inputs (or the fused layers'
  parameters, which their backward needs);
- where a node on that path also leads to parameters off the path, it is an *intermediate*: the
  input half (B) runs ``torch.autograd.grad`` towards the inputs only, keeps the graph, and records
  the gradient arriving at each intermediate (a pre-hook); autograd computes no parameter output
  of those nodes then (it runs only the edges that lead to what was asked);
- the weight half (W) starts again at each intermediate with its recorded gradient and asks for
  its own parameters only (``torch.autograd.backward(..., inputs=params)``): autograd runs the
  node again for those outputs alone and accumulates into ``.grad`` as a single backward would.

Each intermediate's parameters must be reachable from it alone (checked): then no W reaches
another's parameters, and every gradient is the single backward's, summed into ``.grad`` in the
order the W actions run. Graphs that break the rule (a parameter used on two branches, an output
that does not depend on the input) or that would run a Python ``autograd.Function``'s backward in
W (a second time, or later than B: its side effects, e.g. a tensor-parallel collective, would
move) return None: the caller runs the whole backward in B instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

ParamNodes = dict[Node, torch.Tensor]   # a parameter's AccumulateGrad node -> the parameter


def parameter_nodes(params: Iterable[torch.Tensor]) -> ParamNodes:
    """The AccumulateGrad nodes of ``params`` (valid while a graph that uses them is alive)."""
    return {get_gradient_edge(p).node: p for p in params if p.requires_grad}


@dataclass
class WeightHalf:
    """What the input half left: per intermediate, the gradients it received and its parameters."""

    groups: list[tuple[Node, list, tuple[torch.Tensor, ...]]]   # node, its recorded grads, its params

    def run(self) -> None:
        for node, grads, params in self.groups:
            edges = [GradientEdge(node, i) for i, g in enumerate(grads) if g is not None]
            torch.autograd.backward(edges, [g for g in grads if g is not None], inputs=list(params),
                                    retain_graph=True)
        self.groups = []


def _walk(roots: list[Node], stop: set[Node]) -> tuple[dict[Node, bool], list[Node]]:
    """Every node under ``roots`` in post-order (children first), and whether it leads to a node
    of ``stop``. In a graph without cycles a node's children are finished when it is."""
    on_path: dict[Node, bool] = {}
    order: list[Node] = []
    seen: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            on_path[node] = node in stop or any(on_path[c] for c, _ in node.next_functions if c is not None)
            order.append(node)
        elif node not in seen:
            seen.add(node)
            stack.append((node, True))
            stack.extend((c, False) for c, _ in node.next_functions if c is not None and c not in seen)
    return on_path, order


def input_half(outputs: list[torch.Tensor], grads: list[torch.Tensor | None], inputs: list[torch.Tensor],
               split_params: ParamNodes, kept_params: ParamNodes,
               after_accumulate: Callable[[torch.Tensor], None] | None = None) -> WeightHalf | None:
    """Backpropagates ``outputs`` (with ``grads``) to the leaf ``inputs`` (their ``.grad`` set) and
    to ``kept_params`` (accumulated now: the fused layers' parameters, whose backward runs here),
    leaving ``split_params``' gradients to the returned ``WeightHalf``. None (and nothing run)
    where the graph does not split (module docstring)."""
    roots = [t.grad_fn for t in outputs]
    input_nodes = {get_gradient_edge(t).node for t in inputs}
    if not input_nodes or any(r is None for r in roots):
        return None
    on_path, order = _walk(roots, input_nodes | set(kept_params))
    if not all(on_path[r] for r in roots):
        return None
    below: dict[Node, frozenset[Node]] = {}   # off the path: the parameters a node leads to
    groups: list[tuple[Node, tuple[Node, ...]]] = []
    claimed: set[Node] = set()
    for node in order:
        children = [c for c, _ in node.next_functions if c is not None]
        if not on_path[node]:
            reach = set().union(*(below[c] for c in children)) if children else set()
            below[node] = frozenset(reach | ({node} if node in split_params else set()))
            if reach and isinstance(node, BackwardCFunction):
                return None   # a Python backward in W: its side effects (a collective) would move
            continue
        off = set().union(*(below[c] for c in children if not on_path[c])) if children else set()
        if not off:
            continue
        if off & claimed or not off <= split_params.keys() or isinstance(node, BackwardCFunction):
            # a parameter reached from two places or one the split does not own, or a Python
            # backward that W would run a second time (with its side effects)
            return None
        claimed |= off
        groups.append((node, tuple(off)))
    recorded: dict[Node, list] = {}
    handles = [node.register_prehook(_recorder(recorded, node)) for node, _ in groups]
    kept = [p for node, p in kept_params.items() if on_path.get(node)]
    try:
        found = torch.autograd.grad(outputs, [*inputs, *kept], grads, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    for leaf, grad in zip(inputs, found):
        leaf.grad = grad
    for param, grad in zip(kept, found[len(inputs):]):
        if grad is None:
            continue   # a fused weight: its GEMM accumulated (or queued) it
        if param.grad is None:
            param.grad = grad
        else:
            param.grad += grad
        if after_accumulate is not None:
            after_accumulate(param)
    return WeightHalf([(node, recorded[node], tuple(split_params[n] for n in params))
                       for node, params in groups if node in recorded])


def _recorder(recorded: dict[Node, list], node: Node) -> Callable:
    def record(grad_outputs):
        recorded[node] = list(grad_outputs)
    return record
