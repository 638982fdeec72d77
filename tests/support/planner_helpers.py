"""Shared helpers for the planner tests: graph.txt samples, random small profiles and clusters, and
brute-force references."""
from __future__ import annotations

import itertools
import random

from pipedream.devices import DEVICES
from planner.inputs.hardware import Cluster, Level
from planner.inputs.profile import LayerProfile, Profile


# PipeDream's graph.txt profiler output for a chain of layers (edges listed out of order).
CHAIN = """node1 -- Input -- forward_compute_time=0.000, backward_compute_time=0.000, activation_size=600.000, parameter_size=0.000
node2 -- Conv2d(3, 64) -- forward_compute_time=2.000, backward_compute_time=4.000, activation_size=800.000, parameter_size=100.000
node3 -- ReLU(inplace) -- forward_compute_time=0.500, backward_compute_time=1.000, activation_size=800.000, parameter_size=0.000
node4 -- Linear(in_features=8, out_features=2) -- forward_compute_time=1.000, backward_compute_time=3.000, activation_size=16.000, parameter_size=72.000
\tnode1 -- node2
\tnode3 -- node4
\tnode2 -- node3
"""

# A residual connection: node2 feeds node3 and the add (node4); PipeDream's ResNet graphs look like this.
BRANCHY = """node1 -- Input -- forward_compute_time=0.000, backward_compute_time=0.000, activation_size=600.000, parameter_size=0.000
node2 -- Conv2d(3, 64) -- forward_compute_time=2.000, backward_compute_time=4.000, activation_size=800.000, parameter_size=100.000
node3 -- Conv2d(64, 64) -- forward_compute_time=2.000, backward_compute_time=4.000, activation_size=800.000, parameter_size=100.000
node4 -- Add -- forward_compute_time=0.100, backward_compute_time=0.100, activation_size=800.000, parameter_size=0.000
\tnode1 -- node2
\tnode2 -- node3
\tnode2 -- node4
\tnode3 -- node4
"""


def random_profile(rng: random.Random, n_layers: int, blocks: bool = False) -> Profile:
    layers = []
    for i in range(n_layers):
        f1, f2 = rng.uniform(0.1, 2.0), rng.uniform(0.1, 2.0)
        layers.append(LayerProfile(
            name=f"l{i}", kind="block" if blocks else "layer",
            forward_s=(f1, f1 * rng.uniform(1.2, 2.2)), backward_s=(f2, f2 * rng.uniform(1.2, 2.2)),
            output_bytes=rng.uniform(0, 3), parameter_bytes=rng.uniform(0, 5),
            optimizer_bytes=rng.uniform(0, 5), activation_bytes=rng.uniform(0, 4),
            activation_bytes_recompute=rng.uniform(0, 1), recomputable=rng.random() < 0.8,
            tp_forward_bytes=rng.uniform(0, 1), tp_backward_bytes=rng.uniform(0, 1)))
    return Profile("rand", "test", "analytic", "fp32", 1, (1, 2), tuple(layers), 100, 10.0, 13.0)


def random_cluster(rng: random.Random, levels: int, max_count: int = 3) -> Cluster:
    lv = tuple(Level(f"L{k}", rng.randint(1, max_count), rng.uniform(0.5, 5.0), rng.uniform(0, 0.01))
               for k in range(levels))
    return Cluster("rand", DEVICES["a100_80gb"], lv, lv[0].count)


def compositions(n_layers: int, start: int, end: int):
    """All ways to cut [start, end) into contiguous non-empty stages."""
    inner = range(start + 1, end)
    for k in range(0, end - start):
        for cuts in itertools.combinations(inner, k):
            bounds = (start, *cuts, end)
            yield list(zip(bounds[:-1], bounds[1:]))


def replica_splits(total: int, parts: int):
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in replica_splits(total - first, parts - 1):
            yield (first, *rest)


def hierarchical_allreduce(cluster, nbytes, d, t):
    """d members t apart: ring inside one node, else reduce-scatter in the node, ring over nodes on
    the node's NICs shared by all its devices, all-gather in the node (planner/costs/collectives.py)."""
    per_node = cluster.devices_per_node
    if d * t <= per_node or len(cluster.levels) == 1:
        return 2 * (d - 1) / d * nbytes / cluster.level_for_span(d * t).bandwidth
    local = max(min(d, per_node // t), 1) if t <= per_node else 1
    level = cluster.level_for_span(d * t)
    nic = level.node_bandwidth / per_node if level.node_bandwidth else level.bandwidth
    if d % local:
        return 2 * (d - 1) / d * nbytes / min(level.bandwidth, nic)
    nodes = d // local
    inside = 2 * (local - 1) / local * nbytes / cluster.levels[0].bandwidth
    return inside + 2 * (nodes - 1) / nodes * (nbytes / local) / nic


def scalar_uniform(profile, cluster, t, p, v, d, rec, b, schedule, batch, workspace):
    """Independent re-derivation of one equi-replicated configuration (plain loops, formulas written
    out): (iteration time, peak memory per device), or None if the configuration is not valid."""
    n_layers = profile.num_layers
    kinds = [layer.kind for layer in profile.layers]
    units = [i for i, k in enumerate(kinds) if k == "block"] or list(range(n_layers))
    parts = p * v
    if len(units) % parts:
        return None
    if batch % (d * b):
        return None
    m = batch // (d * b)
    if m < 1:
        return None
    if schedule == "interleaved" and (v < 2 or m % p or p < 2):
        return None
    if schedule != "interleaved" and v != 1:
        return None
    if schedule == "2bw" and m < p:
        return None
    per = len(units) // parts
    starts = [0] + [units[j * per] for j in range(1, parts)] + [n_layers]
    fwd, bwd = profile.times(b)
    L = profile.layers
    tp_level = cluster.level_for_span(t)
    pp_level = cluster.level_for_span(p * t * d)
    per_mb, mem = [], []
    working = max((L[i].activation_bytes for i in range(n_layers) if L[i].recomputable), default=0.0) * b if rec else 0.0
    sync = 0.0
    for r in range(p):
        comp = tp = sent = params = opt = act = 0.0
        for c in range(v):
            j = c * p + r
            lo, hi = starts[j], starts[j + 1]
            for i in range(lo, hi):
                comp += fwd[i] + bwd[i] + (fwd[i] if rec and L[i].recomputable else 0.0)
                tp += L[i].tp_forward_bytes + L[i].tp_backward_bytes + (
                    L[i].tp_forward_bytes if rec and L[i].recomputable else 0.0)
                params += L[i].parameter_bytes
                opt += L[i].optimizer_bytes
                act += (L[i].activation_bytes_recompute if rec and L[i].recomputable else L[i].activation_bytes)
            if j < parts - 1:
                sent += L[hi - 1].output_bytes
            if j > 0:
                sent += L[lo - 1].output_bytes
        tp_time = tp * b / tp_level.bandwidth if t > 1 else 0.0
        p2p = 0.0
        if p > 1:
            p2p = sent * b / t / pp_level.bandwidth + 2 * v * pp_level.latency
            if t > 1:
                p2p += sent * b * (t - 1) / t / tp_level.bandwidth
        per_mb.append(comp + tp_time + p2p)
        if schedule == "gpipe":
            flight = m
        elif schedule in ("1f1b", "2bw"):
            flight = min(p - r, m)
        else:
            flight = min((p - r - 1) * 2 + (v - 1) * p + 1, m * v) / v
        versions = 2 if schedule == "2bw" else 1
        mem.append(params * (versions + 1) + opt + act * b * flight + working + workspace)
        if d > 1:
            sync = max(sync, hierarchical_allreduce(cluster, params, d, t))
    stage = max(per_mb)
    if schedule == "2bw":
        time = m * max(stage, sync / m)
    else:
        bubble = (p - 1) / (v * m) if schedule == "interleaved" else (p - 1) / m
        time = stage * m * (1 + bubble) + sync
    return time, max(mem)
