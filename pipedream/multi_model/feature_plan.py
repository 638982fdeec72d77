"""Swap or recompute, per feature map, under a device budget (μ-two §4.2; torch-free).

A feature map is what one fused group of one layer saves for its backward in one micro-batch
(node ``n`` of a chunk's forward order: layer-major, group-minor). ``simulate`` is the memory
simulator: it walks this rank's schedule (forwards and backwards of micro-batches, in order) node
by node and returns the peak of what the device tier would hold. ``plan`` is the greedy choice:
while the simulated peak exceeds the budget, take the kept feature map with the longest inactive
time (swap candidate) and the one with the highest recompute ratio (bytes freed per second of
recomputation), and swap or recompute whichever costs less time.

The order that overlaps swaps: a swapped map of node n is fetched back when the backward of node
n + 1 starts (the other fused group of the same layer, or the next layer), so its copy runs beside
that compute; on a device with a copy stream (CUDA) it overlaps, on the CPU it does not (costed
as such: ``overlapped_copies``).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Decision(enum.Enum):
    KEEP = "keep"
    SWAP = "swap"
    RECOMPUTE = "recompute"


@dataclass(frozen=True)
class FeatureMap:
    chunk: int
    node: int           # position in the chunk's forward order
    layer: int
    group: int
    nbytes: int
    forward_s: float    # also the cost of recomputing it
    backward_s: float


@dataclass(frozen=True)
class Event:
    """A compute of this rank's schedule: forward (or backward) of one micro-batch's chunk."""

    backward: bool
    microbatch: int
    chunk: int


class BudgetTooSmall(ValueError):
    """Even with every feature map swapped or recomputed the peak exceeds the budget."""


def _chunk_maps(maps: list[FeatureMap], chunk: int) -> list[FeatureMap]:
    return sorted((m for m in maps if m.chunk == chunk), key=lambda m: m.node)


def simulate(maps: list[FeatureMap], decisions: dict[tuple[int, int], Decision], events: list[Event],
             base_bytes: int) -> int:
    """Peak bytes held: ``base_bytes`` (weights) plus kept maps from their forward to the end of
    their backward, swapped maps from their prefetch to the end of their backward, recomputed maps
    during their backward only."""
    def decision(m: FeatureMap) -> Decision:
        return decisions.get((m.chunk, m.node), Decision.KEEP)

    resident, peak = base_bytes, base_bytes
    for event in events:
        nodes = _chunk_maps(maps, event.chunk)
        if not event.backward:
            for m in nodes:
                if decision(m) is Decision.KEEP:
                    resident += m.nbytes
                    peak = max(peak, resident)
            continue
        fetched: set[int] = set()
        for position in range(len(nodes) - 1, -1, -1):
            m = nodes[position]
            if decision(m) is not Decision.KEEP and m.node not in fetched:
                resident += m.nbytes     # recomputed now, or swapped in on demand
            if position > 0 and decision(nodes[position - 1]) is Decision.SWAP:
                resident += nodes[position - 1].nbytes   # prefetched beside this backward
                fetched.add(nodes[position - 1].node)
            peak = max(peak, resident)
            resident -= m.nbytes
    return peak


def inactive_s(maps: list[FeatureMap], m: FeatureMap) -> float:
    """Between its forward and its backward in one micro-batch: every later node's forward and
    backward."""
    later = [o for o in maps if o.chunk == m.chunk and o.node > m.node]
    return sum(o.forward_s + o.backward_s for o in later)


def swap_overhead_s(maps: list[FeatureMap], m: FeatureMap, copy_bytes_per_s: float, overlapped_copies: bool
                    ) -> float:
    """Stall a swap adds: the copy back not hidden behind the prompt node's backward (the copy
    out overlaps the forward); without a copy stream both copies stall."""
    copy_s = m.nbytes / copy_bytes_per_s
    if not overlapped_copies:
        return 2 * copy_s
    prompt = [o for o in maps if o.chunk == m.chunk and o.node == m.node + 1]
    window = prompt[0].backward_s if prompt else 0.0
    return max(0.0, copy_s - window)


@dataclass(frozen=True)
class FeaturePlan:
    decisions: dict[tuple[int, int], Decision]
    unoptimised_peak_bytes: int
    planned_peak_bytes: int
    overhead_s: float            # estimated per micro-batch


def plan(maps: list[FeatureMap], events: list[Event], base_bytes: int, budget_bytes: int,
         copy_bytes_per_s: float, overlapped_copies: bool) -> FeaturePlan:
    decisions: dict[tuple[int, int], Decision] = {}
    unoptimised = simulate(maps, decisions, events, base_bytes)
    peak, overhead = unoptimised, 0.0
    while peak > budget_bytes:
        kept = [m for m in maps if (m.chunk, m.node) not in decisions and m.nbytes > 0]
        if not kept:
            raise BudgetTooSmall(f"memory.device_budget_bytes={budget_bytes} is below the {peak} bytes this rank "
                                 f"holds with every feature map swapped or recomputed (weights {base_bytes}): "
                                 f"raise it, or split the models over more pipeline stages")
        swap = max(kept, key=lambda m: (inactive_s(maps, m), m.nbytes))
        recompute = max(kept, key=lambda m: m.nbytes / max(m.forward_s, 1e-9))
        swap_cost = swap_overhead_s(maps, swap, copy_bytes_per_s, overlapped_copies)
        if swap_cost <= recompute.forward_s:
            decisions[(swap.chunk, swap.node)] = Decision.SWAP
            overhead += swap_cost
        else:
            decisions[(recompute.chunk, recompute.node)] = Decision.RECOMPUTE
            overhead += recompute.forward_s
        peak = simulate(maps, decisions, events, base_bytes)
    return FeaturePlan(decisions, unoptimised, peak, overhead)
