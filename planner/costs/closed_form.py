"""Compute, communication and memory models shared by every search.

All functions take scalars or numpy arrays (broadcasting), so searches can evaluate thousands of
configurations at once while the brute-force checks evaluate one. Times in seconds, sizes in bytes.
"""
from __future__ import annotations

import numpy as np

from pipedream.schedules import schedule_info


def pipedream_sync_time(nbytes, replicas, bandwidth):
    """PipeDream's data-parallel term in T^k(i->j, m): 2 (m-1) sum|w_l| / B_k (ch. 2.4.1)."""
    return 2.0 * (np.asarray(replicas, dtype=float) - 1.0) * np.asarray(nbytes) / bandwidth


def pipedream_stage_time(compute, param_bytes, replicas, bandwidth):
    """T^k(i->j, m) = (1/m) max(A^{k-1}(i->j), 2 (m-1) sum|w| / B_k) (ch. 2.4.1)."""
    replicas = np.asarray(replicas, dtype=float)
    return np.maximum(compute, pipedream_sync_time(param_bytes, replicas, bandwidth)) / replicas


def released_stage_time(compute, param_bytes, replicas, bandwidth, sync_divisor=1.0):
    """PipeDream's released optimizer (ch. 2.4.1 as coded in optimizer_graph_hierarchical.py): the
    sync adds to compute instead of overlapping it, (A + 4 (m-1) sum|w| / (B_k m) / div) / m, where
    div is the devices per component for a whole range replicated across components (their GPUs
    sync their shares in parallel) and 1 otherwise."""
    replicas = np.asarray(replicas, dtype=float)
    sync = 4.0 * (replicas - 1.0) * np.asarray(param_bytes) / (bandwidth * replicas) / sync_divisor
    return (np.asarray(compute) + sync) / replicas


def pipedream_boundary_time(output_bytes, bandwidth):
    """Activation forward + gradient backward across a stage boundary: 2 a_s / B_k (ch. 2.4.1)."""
    return 2.0 * np.asarray(output_bytes) / bandwidth


def bubble_fraction(schedule: str, p, m, v=1):
    """Pipeline bubble over ideal time, the schedule's ``ScheduleInfo.bubble``: (p-1)/m for gpipe and
    1f1b, (p-1)/(v m) interleaved (ch. 4.2.2); none in steady state for pipedream and 2bw (ch. 2.4.2,
    3.2.1). The V schedules are planned as one stage per rank (v = 1), split in two."""
    p, m, v = (np.asarray(x, dtype=float) for x in (p, m, v))
    return np.asarray(schedule_info(schedule).bubble(p, m, v), dtype=float)


def flush_iteration_time(schedule: str, stage_time, p, m, v=1):
    """(m + (p-1)/v) (t_f + t_b) for one batch of m micro-batches (eq. 4.1, with ch. 4.2.2's v)."""
    return np.asarray(stage_time) * np.asarray(m) * (1.0 + bubble_fraction(schedule, p, m, v))


def in_flight(schedule: str, p, stage, m, v=1, devices_downstream=None, replicas=1):
    """Micro-batches whose activations a device holds at its peak, in units of a full stage's activations:
    the schedule's ``ScheduleInfo.in_flight`` (micro-batch, chunk) pairs over its chunks per rank.

    gpipe: all m (ch. 4.2.2). 1f1b / 2bw: p - stage, at most m (ch. 3.2.2). interleaved: Megatron's
    warm-up (p - stage - 1) * 2 + (v - 1) * p chunk-forwards plus the one in progress, each 1/v of the
    stage. pipedream: 1F1B-RR admits ceil(devices from this stage on / replicas) (NOAM, ch. 2.4.2).
    """
    info = schedule_info(schedule)
    p, stage, m, v = (np.asarray(x, dtype=float) for x in (p, stage, m, v))
    if info.replicated_stages:
        down = p - stage if devices_downstream is None else np.asarray(devices_downstream, dtype=float)
        return np.ceil(down / np.asarray(replicas, dtype=float))
    return np.asarray(info.in_flight(stage, p, m, v), dtype=float) / info.chunks(v)


def weight_versions(schedule: str, in_flight_count=1):
    """Weight copies a device keeps (``ScheduleInfo.weight_versions``): 1 with flushes, 2 with 2BW
    (ch. 3.2.1), one per in-flight input with PipeDream's weight stashing (ch. 2.4.3)."""
    return schedule_info(schedule).weight_versions(in_flight_count)


def device_memory(param_bytes, optimizer_bytes, versions, activation_bytes, in_flight_count,
                  working_bytes=0.0, workspace_bytes=0.0, gradient_bytes=None):
    """weights x versions + gradients (one weight's size unless ``gradient_bytes`` says otherwise:
    ZeRO-3 with reshard_after_forward holds its own mix of shards and whole layers of each) +
    optimizer state + stashed activations x in-flight + the recompute working set + workspace
    (ch. 3.3.3 MEMORY(.), extended with the optimizer)."""
    grads = np.asarray(param_bytes) if gradient_bytes is None else np.asarray(gradient_bytes)
    return (np.asarray(param_bytes) * np.asarray(versions) + grads + optimizer_bytes
            + np.asarray(activation_bytes) * in_flight_count + working_bytes + workspace_bytes)


def stage_compute(forward, backward, recompute: bool, recomputable_forward=None):
    """Forward + backward, plus the forward again for recomputed layers (ch. 3.3.1, 4.3.5)."""
    total = np.asarray(forward) + np.asarray(backward)
    if recompute:
        total = total + (forward if recomputable_forward is None else recomputable_forward)
    return total


def tflops_per_device(flops_per_iteration, iteration_time, devices):
    """Achieved FLOP/s per device as Table 4.1 counts it: model FLOPs / (time x devices)."""
    return np.asarray(flops_per_iteration) / (np.asarray(iteration_time) * devices) / 1e12
