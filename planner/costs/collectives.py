"""Collective communication times on a hierarchical cluster.

Data-parallel gradients are all-reduced hierarchically, as NCCL does on multi-NIC servers such as
the DGX A100 (8 x 200 Gb/s HDR per node): a reduce-scatter among the group's members inside a node
over NVLink, an all-reduce of each member's 1/g slice across nodes (every GPU of the node drives
its share of the node's NICs at once), and an all-gather inside the node. A flat ring charged at
one NIC per GPU would move the full gradient across nodes from every GPU, g times too much.
"""
from __future__ import annotations

import numpy as np

from planner.inputs.cluster_sheet import measured_allreduce
from planner.inputs.hardware import Cluster


def ring_time(nbytes, n, bandwidth):
    """Ring all-reduce: each of n workers sends 2 (n-1)/n of the bytes (ch. 2.4.1, 4.3.3)."""
    n = np.asarray(n, dtype=float)
    return 2.0 * (n - 1.0) / np.maximum(n, 1.0) * np.asarray(nbytes) / bandwidth


def local_members(cluster: Cluster, group: int, stride: int) -> int:
    """Members of a group (``group`` devices, ``stride`` apart) that share a node."""
    per_node = cluster.devices_per_node
    return max(1, min(group, per_node // stride)) if stride <= per_node else 1


def allreduce_time(cluster: Cluster, nbytes, group: int, stride: int = 1):
    """All-reduce of ``nbytes`` per device over ``group`` devices whose ranks are ``stride`` apart
    (data-parallel groups: stride = tensor-parallel degree, as the runtime lays groups out)."""
    if group <= 1:
        return np.zeros_like(np.asarray(nbytes, dtype=float))
    measured = measured_allreduce(cluster, np.asarray(nbytes, dtype=float), group)
    if measured is not None:  # cluster=measured: Gloo's all-reduce as calibrated on this machine
        return measured
    span = group * stride
    if span <= cluster.devices_per_node or len(cluster.levels) == 1:
        return ring_time(nbytes, group, cluster.bandwidth_for_span(span))
    g = local_members(cluster, group, stride)
    inter = cluster.level_for_span(span)
    per_gpu = inter.node_bandwidth / cluster.devices_per_node if inter.node_bandwidth else inter.bandwidth
    if group % g:  # the group straddles node edges unevenly: a flat ring over the slowest link
        return ring_time(nbytes, group, min(inter.bandwidth, per_gpu))
    nodes = group // g
    intra = cluster.levels[0].bandwidth
    slice_bytes = np.asarray(nbytes, dtype=float) / g
    local = 2.0 * (g - 1) / g * np.asarray(nbytes, dtype=float) / intra  # reduce-scatter + all-gather
    return local + ring_time(slice_bytes, nodes, per_gpu)
