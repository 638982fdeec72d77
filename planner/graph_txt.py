"""Import a profile from PipeDream's profiler output (``graph.txt``), for linear chains.

Format (msr-fiddle/pipedream, graph/graph.py): one line per node,
``nodeN -- <description> -- forward_compute_time=<ms>, backward_compute_time=<ms>,
activation_size=<bytes>, parameter_size=<bytes>[ -- stage_id=<k>]``, then one tab-indented line
per edge, ``\\tnodeA -- nodeB``. Sizes are for the profiled mini-batch. ``Input`` sources are
dropped (their output is the model's input), as PipeDream's optimizer does. A graph where some
node has several producers or consumers needs PipeDream's antichain DAG, which this importer does
not build: it says so and names the node.
"""
from __future__ import annotations

import re
from pathlib import Path

from .errors import ProfileError
from .profile import LayerProfile, Profile

_NODE = re.compile(r"^(\w+) -- (.*) -- forward_compute_time=([\d.eE+-]+), backward_compute_time=([\d.eE+-]+), "
                   r"activation_size=([\d.eE+-]+), parameter_size=([\d.eE+-]+)")
_EDGE = re.compile(r"^\s+(\w+) -- (\w+)\s*$")
ADAM_STATE_PER_WEIGHT = 2.0  # Adam's m and v, each the size of the weights (fp32, as PipeDream trained)


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
        nodes[name] = (desc, float(fwd), float(bwd), float(act), float(params))
    for src, dst in edges:
        for end in (src, dst):
            if end not in nodes:
                raise ProfileError(f"graph.txt edge {src} -- {dst} names an unknown node {end}")
    return nodes, edges


def chain_order(nodes: dict[str, tuple], edges: list[tuple[str, str]]) -> list[str]:
    """The nodes in order if the graph is a linear chain; ProfileError naming the first branch otherwise."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    pred: dict[str, list[str]] = {n: [] for n in nodes}
    for src, dst in edges:
        succ[src].append(dst)
        pred[dst].append(src)
    hint = ("PipeDream's antichain DAG for branchy graphs is not supported; profile a chain of layers "
            "(python -m planner.profile) or use an analytic preset (e.g. model=resnet50)")
    for name in nodes:
        if len(succ[name]) > 1:
            raise ProfileError(f"graph.txt is not a linear chain: {name} ({nodes[name][0][:30]}) feeds "
                               f"{len(succ[name])} nodes ({', '.join(succ[name][:3])}); {hint}")
        if len(pred[name]) > 1:
            raise ProfileError(f"graph.txt is not a linear chain: {name} ({nodes[name][0][:30]}) joins "
                               f"{len(pred[name])} inputs ({', '.join(pred[name][:3])}); {hint}")
    sources = [n for n in nodes if not pred[n]]
    if len(sources) != 1:
        raise ProfileError(f"graph.txt is not a linear chain: {len(sources)} source nodes "
                           f"({', '.join(sources[:3])}); {hint}")
    order = [sources[0]]
    while succ[order[-1]]:
        order.append(succ[order[-1]][0])
    if len(order) != len(nodes):
        raise ProfileError(f"graph.txt is not one connected chain: {len(order)} of {len(nodes)} nodes reachable")
    return order


def import_graph(path: str | Path, micro_batch: int, name: str = "graph") -> Profile:
    """Profile of a chain graph profiled at ``micro_batch`` samples (times in ms in the file)."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ProfileError(f"cannot read graph.txt {path}: {err.strerror or err}") from None
    return profile_from_graph(text, micro_batch, name)


def profile_from_graph(text: str, micro_batch: int, name: str = "graph") -> Profile:
    nodes, edges = parse_graph(text)
    inputs = [n for n, v in nodes.items() if v[0].startswith("Input") and not any(dst == n for _, dst in edges)]
    edges = [(s, d) for s, d in edges if s not in inputs]
    for n in inputs:
        del nodes[n]
    if not nodes:
        raise ProfileError("graph.txt has no layers besides its inputs")
    layers = []
    for node in chain_order(nodes, edges):
        desc, fwd, bwd, act, params = nodes[node]
        per_sample = act / micro_batch
        layers.append(LayerProfile(
            name=f"{node}:{desc.split('(')[0]}", kind="layer", forward_s=(fwd / 1000.0,), backward_s=(bwd / 1000.0,),
            output_bytes=per_sample, parameter_bytes=params, optimizer_bytes=ADAM_STATE_PER_WEIGHT * params,
            activation_bytes=per_sample, activation_bytes_recompute=per_sample))
    params = sum(layer.parameter_bytes for layer in layers) / 4  # fp32 weights
    return Profile(name, "graph.txt", "graph.txt", "fp32", 1, (micro_batch,), tuple(layers), int(params))
