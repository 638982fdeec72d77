"""Harmony's balanced time packing (Algorithm 2 of the Harmony paper) and the device bytes of a pack.

A *pack* is a contiguous layer range [start, end) that one task runs over a group of
micro-batches. Packing chooses the fewest packs whose per-pack times are as equal as possible
and whose every pack fits the device budget:

    for S = ceil(sum(bytes) / budget) .. R:       # fewest packs first (largest packs)
        cut the prefix sums of the layer times at c, 2c, ..., (S-1)c with c = sum(t) / S
        if every pack's bytes <= budget: return the packs

One pass costs O(R) (prefix sums, a binary search per cut, a running sum per pack), so the whole
loop is O(R^2). Torch-free: profiles come in as numpy columns (``planner.inputs.profile``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from planner.inputs.profile import Profile

Pack = tuple[int, int]  # [start, end) of the model's layer list


@dataclass(frozen=True)
class LayerBytes:
    """Per-layer byte columns a pack's device footprint is summed from (per sample where noted)."""

    weights: np.ndarray         # parameter bytes (the gradients are as large)
    activations: np.ndarray     # per sample, what autograd keeps for the backward
    inputs: np.ndarray          # per sample, the layer's input (the previous layer's output; 0 for layer 0)
    outputs: np.ndarray         # per sample, the layer's output

    @classmethod
    def from_profile(cls, profile: Profile) -> "LayerBytes":
        cols = profile.arrays
        out = cols["output_bytes"]
        return cls(cols["parameter_bytes"], cols["activation_bytes"], np.concatenate(([0.0], out[:-1])), out)

    @property
    def num_layers(self) -> int:
        return int(self.weights.size)


def forward_pack_bytes(layers: LayerBytes, pack: Pack, micro: int, recompute: bool) -> float:
    """Device bytes of a forward task: the pack's weights, one micro-batch's input and output, and
    its activations: with recomputation only the largest layer's at a time (nothing is kept for the
    backward but the pack input), without it the whole pack's graph of one micro-batch."""
    s, e = pack
    acts = layers.activations[s:e]
    live = float(acts.max()) if recompute else float(acts.sum())
    return float(layers.weights[s:e].sum()) + micro * (float(layers.inputs[s]) + float(layers.outputs[e - 1]) + live)


def stash_per_sample(layers: LayerBytes, pack: Pack, recompute: bool) -> float:
    """What a forward pack keeps per sample for its backward: the pack input with recomputation,
    else every layer's activations."""
    s, e = pack
    return float(layers.inputs[s]) if recompute else float(layers.activations[s:e].sum())


def backward_pack_bytes(layers: LayerBytes, pack: Pack, micro: int, stash_samples: int = 0,
                        recompute: bool = True) -> float:
    """Device bytes of a backward task: weights and their gradients, one micro-batch's activations of
    the whole pack (recomputed or kept), its input and the output gradient coming in, and the
    stashes of ``stash_samples`` samples brought back from the forward."""
    s, e = pack
    return (2.0 * float(layers.weights[s:e].sum())
            + micro * (float(layers.activations[s:e].sum()) + float(layers.inputs[s]) + float(layers.outputs[e - 1]))
            + stash_samples * stash_per_sample(layers, pack, recompute))


def pack_bytes_fn(kind: str, layers: LayerBytes, micro: int, recompute: bool, stash_samples: int = 0):
    if kind == "F":
        return lambda pack: forward_pack_bytes(layers, pack, micro, recompute)
    if kind == "B":
        return lambda pack: backward_pack_bytes(layers, pack, micro, stash_samples, recompute)
    raise ValueError(f"pack kind {kind!r}: F or B")


def balanced_cuts(times: np.ndarray, packs: int) -> list[Pack]:
    """Split layers into ``packs`` contiguous ranges whose times are closest to sum/packs each:
    cut k goes where the prefix sum is nearest to k*c (one binary search per cut). Ties and empty
    ranges are resolved by keeping every range non-empty."""
    n = int(times.size)
    prefix = np.concatenate(([0.0], np.cumsum(times)))  # prefix[j] = time of layers [0, j)
    targets = prefix[-1] * np.arange(1, packs) / packs
    right = np.clip(np.searchsorted(prefix, targets), 1, n)
    left = right - 1
    nearer_left = np.abs(prefix[left] - targets) <= np.abs(prefix[right] - targets)
    cuts = np.where(nearer_left, left, right)
    bounds, last = [0], 0
    for k, cut in enumerate(cuts.tolist()):  # strictly increasing, leaving room for the packs after
        cut = min(max(cut, last + 1), n - (packs - 1 - k))
        bounds.append(cut)
        last = cut
    bounds.append(n)
    return [(bounds[i], bounds[i + 1]) for i in range(packs)]


def balanced_time_packing(times: np.ndarray, pack_bytes, budget: float) -> list[Pack] | None:
    """Algorithm 2: the fewest packs of balanced time that each fit ``budget``; None when even one
    layer per pack does not fit. ``pack_bytes(pack)`` gives a pack's device bytes. The count starts
    at ceil(bytes of all layers as one pack / budget): packs' bytes add up to at least that."""
    n = int(times.size)
    if n == 0:
        return []
    first = max(1, min(n, math.ceil(pack_bytes((0, n)) / budget))) if budget > 0 else n
    for count in range(first, n + 1):
        packs = balanced_cuts(times, count)
        if all(pack_bytes(p) <= budget for p in packs):
            return packs
    return None


def pack_layers(kind: str, times: np.ndarray, layers: LayerBytes, micro: int, budget: float, recompute: bool,
                first: int = 0, last: int | None = None, stash_samples: int = 0) -> list[Pack] | None:
    """Algorithm 2 over layers [first, last) for forward (``F``) or backward (``B``) tasks of
    ``micro`` samples (a backward holding ``stash_samples`` samples' stashes); packs are in the
    model's layer numbering."""
    last = layers.num_layers if last is None else last
    if last <= first:
        return []
    fn = pack_bytes_fn(kind, layers, micro, recompute, stash_samples)
    shifted = lambda pack: fn((pack[0] + first, pack[1] + first))  # noqa: E731 - local adapter
    packs = balanced_time_packing(np.asarray(times[first:last], dtype=float), shifted, budget)
    return None if packs is None else [(s + first, e + first) for s, e in packs]
