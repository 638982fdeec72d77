"""Import a profile from PipeDream's profiler output (``graph.txt``): chains and DAGs.

Format (msr-fiddle/pipedream, graph/graph.py): one line per node,
``nodeN -- <description> -- forward_compute_time=<ms>, backward_compute_time=<ms>,
activation_size=<bytes>, parameter_size=<bytes>[ -- stage_id=<k>]``, then one tab-indented line
per edge, ``\\tnodeA -- nodeB``. Sizes are for the profiled mini-batch; a node returning several
tensors (an LSTM's output and state) lists them, ``activation_size=[a; b; c]``, and counts their
sum. As PipeDream's optimizer does, ``Input`` sources are dropped (their output is the model's
input) and so are ``__getitem__`` sinks (tuple members nobody reads).

A branchy graph (ResNet's residual adds, GNMT's several inputs) is linearised the way PipeDream's
antichain DAG is: the nodes are put in one topological order (ties broken by node number, the
order the profiler traced them), so every prefix is a set closed under predecessors, i.e. one of
PipeDream's antichain states; the pipeline cuts between nodes of that order. The bytes sent across
a cut are the sum over every tensor live across it: each node before the cut with a consumer after
it, as PipeDream's augmented antichain sums them (docs/planner.md).
"""
from __future__ import annotations

import heapq
import re
from pathlib import Path

from planner.errors import ProfileError
from planner.inputs.profile import LayerProfile, Profile

_SIZE = r"(\[[^\]]*\]|[\d.eE+-]+)"
_NODE = re.compile(r"^(\w+) -- (.*) -- forward_compute_time=([\d.eE+-]+), backward_compute_time=([\d.eE+-]+), "
                   rf"activation_size={_SIZE}, parameter_size={_SIZE}")
_EDGE = re.compile(r"^\s+(\w+) -- (\w+)\s*$")
ADAM_STATE_PER_WEIGHT = 2.0  # Adam's m and v, each the size of the weights (fp32, as PipeDream trained)


def parse_size(text: str, line: int) -> float:
    """``123.0`` or a list ``[a; b; c]`` (a node returning several tensors): their sum."""
    try:
        if text.startswith("["):
            return sum(float(part) for part in text[1:-1].split(";") if part.strip())
        return float(text)
    except ValueError:
        raise ProfileError(f"graph.txt line {line} has a size {text[:40]!r} that is neither a number nor "
                           f"a [a; b] list of numbers") from None


def parse_graph(text: str) -> tuple[dict[str, tuple], list[tuple[str, str]]]:
    nodes: dict[str, tuple] = {}
    edges: list[tuple[str, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        edge = _EDGE.match(line)
        if edge:
            edges.append((edge.group(1), edge.group(2)))
            continue
        node = _NODE.match(line)
        if not node:
            raise ProfileError(f"graph.txt line {number} is neither a node nor an edge: {line[:60]!r}")
        name, desc, fwd, bwd, act, params = node.groups()
        nodes[name] = (desc, float(fwd), float(bwd), parse_size(act, number), parse_size(params, number))
    for src, dst in edges:
        for end in (src, dst):
            if end not in nodes:
                raise ProfileError(f"graph.txt edge {src} -- {dst} names an unknown node {end}")
    return nodes, edges


def _node_number(name: str) -> tuple[int, str]:
    digits = re.sub(r"\D", "", name)
    return (int(digits) if digits else -1, name)


def topological_order(nodes: dict[str, tuple], edges: list[tuple[str, str]]) -> list[str]:
    """Kahn's algorithm taking the lowest-numbered ready node first; ProfileError on a cycle."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    waiting = {n: 0 for n in nodes}
    for src, dst in set(edges):
        succ[src].append(dst)
        waiting[dst] += 1
    ready = [_node_number(n) for n, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        name = heapq.heappop(ready)[1]
        order.append(name)
        for dst in succ[name]:
            waiting[dst] -= 1
            if waiting[dst] == 0:
                heapq.heappush(ready, _node_number(dst))
    if len(order) != len(nodes):
        stuck = sorted((n for n in nodes if waiting[n] > 0), key=_node_number)
        raise ProfileError(f"graph.txt has a cycle through {', '.join(stuck[:3])}: a profile is a DAG of layers")
    return order


def cut_bytes(order: list[str], nodes: dict[str, tuple], edges: list[tuple[str, str]]) -> list[float]:
    """Bytes crossing the cut after each position of ``order``: the outputs of every node at or
    before it that a node after it consumes."""
    position = {name: i for i, name in enumerate(order)}
    last_use = {name: position[name] for name in order}
    for src, dst in edges:
        last_use[src] = max(last_use[src], position[dst])
    change = [0.0] * (len(order) + 1)
    for name in order:   # live across the cuts position[name] .. last_use[name] - 1
        if last_use[name] > position[name]:
            change[position[name]] += nodes[name][3]
            change[last_use[name]] -= nodes[name][3]
    crossing, running = [], 0.0
    for delta in change[:-1]:
        running += delta
        crossing.append(running)
    return crossing


def pipedream_pruned(nodes: dict[str, tuple], edges: list[tuple[str, str]]
                     ) -> tuple[dict[str, tuple], list[tuple[str, str]]]:
    """Without ``Input`` sources and ``__getitem__`` sinks, as PipeDream's optimizer prunes them."""
    has_pred = {dst for _, dst in edges}
    has_succ = {src for src, _ in edges}
    dropped = {n for n, v in nodes.items() if v[0].startswith("Input") and n not in has_pred}
    dropped |= {n for n, v in nodes.items() if v[0].startswith("__getitem__") and n not in has_succ}
    return ({n: v for n, v in nodes.items() if n not in dropped},
            [(s, d) for s, d in edges if s not in dropped and d not in dropped])


def import_graph(path: str | Path, micro_batch: int, name: str = "graph") -> Profile:
    """Profile of a chain graph profiled at ``micro_batch`` samples (times in ms in the file)."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ProfileError(f"cannot read graph.txt {path}: {err.strerror or err}") from None
    return profile_from_graph(text, micro_batch, name)


def profile_from_graph(text: str, micro_batch: int, name: str = "graph") -> Profile:
    nodes, edges = pipedream_pruned(*parse_graph(text))
    if not nodes:
        raise ProfileError("graph.txt has no layers besides its inputs")
    order = topological_order(nodes, edges)
    crossing = cut_bytes(order, nodes, edges)
    layers = []
    for position, node in enumerate(order):
        desc, fwd, bwd, act, params = nodes[node]
        own = act / micro_batch
        sent = own if position == len(order) - 1 else crossing[position] / micro_batch
        layers.append(LayerProfile(
            name=f"{node}:{desc.split('(')[0]}", kind="layer", forward_s=(fwd / 1000.0,), backward_s=(bwd / 1000.0,),
            output_bytes=sent, parameter_bytes=params, optimizer_bytes=ADAM_STATE_PER_WEIGHT * params,
            activation_bytes=own, activation_bytes_recompute=own))
    params = sum(layer.parameter_bytes for layer in layers) / 4  # fp32 weights
    return Profile(name, "graph.txt", "graph.txt", "fp32", 1, (micro_batch,), tuple(layers), int(params))
