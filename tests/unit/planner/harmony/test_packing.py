"""Balanced time packing (Harmony's Algorithm 2) and the pack memory model, checked by hand."""
from __future__ import annotations

import itertools

import numpy as np

from planner.harmony.packing import (LayerBytes, backward_pack_bytes, balanced_cuts, balanced_time_packing,
                                     forward_pack_bytes, pack_layers)


def layers(weights, acts, outs) -> LayerBytes:
    outs = np.asarray(outs, dtype=float)
    return LayerBytes(np.asarray(weights, dtype=float), np.asarray(acts, dtype=float),
                      np.concatenate(([0.0], outs[:-1])), outs)


def test_pack_bytes_by_hand():
    lb = layers([10, 20, 30], [1, 5, 2], [3, 4, 6])
    # forward [1,3), micro 2, recompute: weights 20+30=50, input 3 and output 6 per sample,
    # largest activation 5 per sample: 50 + 2*(3+6+5) = 78
    assert forward_pack_bytes(lb, (1, 3), 2, recompute=True) == 78
    # without recomputation the pack's activations add up: 50 + 2*(3+6+7) = 82
    assert forward_pack_bytes(lb, (1, 3), 2, recompute=False) == 82
    # backward [0,2), micro 3: 2*(10+20) + 3*(1+5 + 0 + 4) = 60 + 30 = 90
    assert backward_pack_bytes(lb, (0, 2), 3) == 90


def test_cuts_balance_prefix_sums():
    # times 1,1,1,1,4: two packs target 4 each -> [0,4) and [4,5)
    assert balanced_cuts(np.array([1, 1, 1, 1, 4.0]), 2) == [(0, 4), (4, 5)]
    # one dominant layer never leaves an empty pack
    assert balanced_cuts(np.array([10, 0.1, 0.1]), 3) == [(0, 1), (1, 2), (2, 3)]


def _best_by_brute_force(times, fn, budget):
    """Every split into S packs, S from small to large; the first S with a fitting split (the
    search never has fewer packs than that)."""
    n = len(times)
    for count in range(1, n + 1):
        for cuts in itertools.combinations(range(1, n), count - 1):
            bounds = (0, *cuts, n)
            if all(fn((bounds[i], bounds[i + 1])) <= budget for i in range(count)):
                return count
    return None


def test_fewest_packs_that_fit_and_balance():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 8))
        lb = layers(rng.uniform(1, 10, n), rng.uniform(0, 3, n), rng.uniform(0, 3, n))
        times = rng.uniform(0.1, 2, n)
        fn = lambda p: backward_pack_bytes(lb, p, 1)  # noqa: E731
        budget = float(rng.uniform(5, 60))
        packs = balanced_time_packing(times, fn, budget)
        fewest = _best_by_brute_force(times, fn, budget)
        if fewest is None:
            assert packs is None
            continue
        assert packs is not None and packs[0][0] == 0 and packs[-1][1] == n
        assert all(fn(p) <= budget for p in packs)
        assert all(a[1] == b[0] for a, b in zip(packs, packs[1:]))
        assert len(packs) >= fewest  # balanced cuts may need more packs than the best split


def test_single_layer_over_budget_is_none():
    lb = layers([10, 100, 10], [0, 0, 0], [0, 0, 0])
    assert pack_layers("F", np.ones(3), lb, 1, 50.0, True) is None


def test_pack_layers_offsets_and_time_balance():
    lb = layers([1] * 6, [0] * 6, [0] * 6)
    # budget 3 bytes of weights per forward pack: 2 packs of 3 layers would fit; equal times -> even
    assert pack_layers("F", np.ones(6), lb, 1, 3.0, True) == [(0, 3), (3, 6)]
    # layers [2, 6) only, uneven times 1,1,1,3: two packs target 3 each -> [2,5) [5,6)
    assert pack_layers("F", np.array([9, 9, 1, 1, 1, 3.0]), lb, 1, 3.0, True, first=2) == [(2, 5), (5, 6)]
