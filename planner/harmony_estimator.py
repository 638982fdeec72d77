"""Harmony's runtime estimator: an event-driven simulation of one iteration's task lists.

Each device has a compute stream and two copy streams (host->device swap-ins, device->host
swap-outs), as the runtime runs swaps on their own streams; a device-to-device send occupies the
sender's send stream. A task's swap-in is issued when the previous task on its device starts
computing (prefetch one task ahead) and may overlap that task. A task computes its micro-batches
one after another; micro-batch j waits for its inputs (the previous task's micro-batches that hold
its samples, after their send) and for the swap-ins. Swap-outs (gradients, stashed pack inputs)
start as soon as their micro-batch or task is done; the host's update of a pack runs after its
gradients arrive, on one host update stream per device.

Tasks are visited in index order: every dependency points to a lower index (the generator's order),
so one pass computes every start and end. Peak device memory is a sweep over the intervals in
which each task's bytes are resident (from its swap-in's start to its swap-out's end).
Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Item:
    """One micro-batch of a task: compute seconds, bytes sent to the next task, bytes swapped out
    (a stashed input), and the (task, item) pairs it needs first."""

    seconds: float
    send_bytes: float = 0.0
    stash_out_bytes: float = 0.0
    needs: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Task:
    index: int
    device: int
    kind: str                    # "F", "B" (a backward, with the jit pack's forward folded in)
    items: tuple[Item, ...]
    swap_in_bytes: float         # weights and stashed inputs brought in before the first item
    swap_out_bytes: float = 0.0  # gradients written back after the last item
    resident_bytes: float = 0.0  # peak device bytes while it runs (weights, grads, activations)
    host_update_s: float = 0.0   # the host's optimizer step on this pack after its gradients arrive
    send_to: int | None = None   # device of the task that takes its output


@dataclass(frozen=True)
class Links:
    swap_bandwidth: float         # bytes/s host<->device, each direction
    p2p_bandwidth: float          # bytes/s device->device
    p2p_latency: float = 0.0
    swap_latency: float = 0.0


@dataclass
class Estimate:
    iteration_s: float
    peak_bytes: list[float]
    compute_s: list[float]
    swap_in_bytes: float
    swap_out_bytes: float
    p2p_bytes: float
    task_spans: list[tuple[float, float]] = field(default_factory=list)  # (first item start, last item end)


def _copy(bytes_: float, bandwidth: float, latency: float) -> float:
    return 0.0 if bytes_ <= 0 else latency + bytes_ / bandwidth


def estimate(tasks: list[Task], devices: int, links: Links) -> Estimate:
    """Simulate one iteration; ``tasks`` in index order with dependencies on lower indices."""
    compute_free = [0.0] * devices
    h2d_free = [0.0] * devices
    d2h_free = [0.0] * devices
    send_free = [0.0] * devices
    host_free = [0.0] * devices
    last_start = [0.0] * devices           # when the previous task on the device began computing
    arrive: dict[tuple[int, int], float] = {}
    intervals: list[tuple[int, float, float, float]] = []
    spans, finish = [], 0.0
    busy = [0.0] * devices
    totals = {"in": 0.0, "out": 0.0, "p2p": 0.0}
    for task in tasks:
        d = task.device
        swap_start = max(h2d_free[d], last_start[d])
        swap_done = swap_start + _copy(task.swap_in_bytes, links.swap_bandwidth, links.swap_latency)
        h2d_free[d] = swap_done
        totals["in"] += task.swap_in_bytes
        clock = max(compute_free[d], swap_done)
        first = None
        for j, item in enumerate(task.items):
            ready = max([clock, *(arrive[need] for need in item.needs)])
            first = ready if first is None else first
            clock = ready + item.seconds
            busy[d] += item.seconds
            if item.stash_out_bytes > 0:
                d2h_free[d] = max(d2h_free[d], clock) + _copy(item.stash_out_bytes, links.swap_bandwidth,
                                                                links.swap_latency)
                totals["out"] += item.stash_out_bytes
                finish = max(finish, d2h_free[d])
            if task.send_to is not None and task.send_to != d and item.send_bytes > 0:
                send_free[d] = max(send_free[d], clock) + _copy(item.send_bytes, links.p2p_bandwidth,
                                                                links.p2p_latency)
                arrive[(task.index, j)] = send_free[d]
                totals["p2p"] += item.send_bytes
            else:
                arrive[(task.index, j)] = clock
        first = clock if first is None else first
        last_start[d], compute_free[d] = first, clock
        released = clock
        if task.swap_out_bytes > 0:
            d2h_free[d] = max(d2h_free[d], clock) + _copy(task.swap_out_bytes, links.swap_bandwidth,
                                                            links.swap_latency)
            totals["out"] += task.swap_out_bytes
            released = d2h_free[d]
            if task.host_update_s > 0:
                host_free[d] = max(host_free[d], released) + task.host_update_s
                finish = max(finish, host_free[d])
        intervals.append((d, swap_start, released, task.resident_bytes))
        spans.append((first, clock))
        finish = max(finish, released, clock)
    return Estimate(finish, _peaks(intervals, devices), busy, totals["in"], totals["out"], totals["p2p"], spans)


def _peaks(intervals: list[tuple[int, float, float, float]], devices: int) -> list[float]:
    """Largest sum of bytes resident at one instant per device; a release at t comes before an
    acquisition at t (the runtime frees a pack before the next one's swap-in lands)."""
    peaks = [0.0] * devices
    for dev in range(devices):
        events = sorted([(start, 1, size) for d, start, _, size in intervals if d == dev]
                        + [(end, 0, -size) for d, _, end, size in intervals if d == dev])
        level = 0.0
        for _, _, delta in events:
            level += delta
            peaks[dev] = max(peaks[dev], level)
    return peaks
