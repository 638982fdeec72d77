"""Harmony's runtime estimator: an event-driven simulation of one iteration's task lists.

Each device has a compute stream and two copy streams (host->device swap-ins, device->host
swap-outs), as the runtime runs swaps on their own streams; a device-to-device send occupies the
sender's send stream. A task's swap-in is issued when the previous task on its device starts
computing (prefetch one task ahead) and may overlap that task, unless both tasks' bytes together
exceed the device budget: then it waits until the previous task has released its pack. A task computes its micro-batches
one after another; micro-batch j waits for its inputs (the previous task's micro-batches that hold
its samples, after their send) and for the swap-ins. Swap-outs (gradients, stashed pack inputs)
start as soon as their micro-batch or task is done; the host's update of a pack runs after its
gradients arrive, on one host update stream per device.

With ``Links.synchronous`` (the CPU runtime, where "device" and host are both RAM and one process
does everything) swaps, stash copies and the host update run on the compute stream instead, one
after another; sends still overlap (Gloo sends from its own thread).

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
    synchronous: bool = False     # copies and the host update block the compute stream (CPU)


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


def estimate(tasks: list[Task], devices: int, links: Links, budget: float = float("inf")) -> Estimate:
    """Simulate one iteration; ``tasks`` in index order with dependencies on lower indices."""
    compute_free = [0.0] * devices
    h2d_free = [0.0] * devices
    d2h_free = [0.0] * devices
    send_free = [0.0] * devices
    host_free = [0.0] * devices
    last_start = [0.0] * devices           # when the previous task on the device began computing
    held = [(0.0, 0.0)] * devices          # the previous task's (bytes, release time)
    arrive: dict[tuple[int, int], float] = {}
    intervals: list[tuple[int, float, float, float]] = []
    spans, finish = [], 0.0
    busy = [0.0] * devices
    totals = {"in": 0.0, "out": 0.0, "p2p": 0.0}
    for task in tasks:
        d = task.device
        sync = links.synchronous
        swap_start = compute_free[d] if sync else max(h2d_free[d], last_start[d])
        if held[d][0] + task.resident_bytes > budget:
            swap_start = max(swap_start, held[d][1])
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
                stash_s = _copy(item.stash_out_bytes, links.swap_bandwidth, links.swap_latency)
                if sync:
                    clock += stash_s
                else:
                    d2h_free[d] = max(d2h_free[d], clock) + stash_s
                    finish = max(finish, d2h_free[d])
                totals["out"] += item.stash_out_bytes
            if task.send_to is not None and task.send_to != d and item.send_bytes > 0:
                send_free[d] = max(send_free[d], clock) + _copy(item.send_bytes, links.p2p_bandwidth,
                                                                links.p2p_latency)
                arrive[(task.index, j)] = send_free[d]
                totals["p2p"] += item.send_bytes
            else:
                arrive[(task.index, j)] = clock
        first = clock if first is None else first
        end = clock
        released = clock
        if task.swap_out_bytes > 0:
            out_s = _copy(task.swap_out_bytes, links.swap_bandwidth, links.swap_latency)
            totals["out"] += task.swap_out_bytes
            if sync:
                clock = released = clock + out_s
                clock += task.host_update_s
            else:
                d2h_free[d] = max(d2h_free[d], clock) + out_s
                released = d2h_free[d]
                host_free[d] = max(host_free[d], released) + task.host_update_s
                finish = max(finish, host_free[d])
        last_start[d], compute_free[d] = first, clock
        intervals.append((d, swap_start, released, task.resident_bytes))
        held[d] = (task.resident_bytes, released)
        spans.append((first, end))
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
