"""recompute.num_layers = k in the PTD-P cost model: each chunk's first k layers are recomputed (they keep
their input, their forward runs again in the backward), the rest keep their activations."""
from __future__ import annotations

import numpy as np
import pytest

from planner.config import compose, inputs_from_config
from planner.costs.uniform import even_boundaries, rank_stats
from planner.inputs.memory_options import MemoryOptions
from planner.search.auto import make_plan


@pytest.fixture(scope="module")
def inputs():
    return inputs_from_config(compose(["model=gpt_1.7b", "cluster=dgx_a100", "cluster.nodes=4",
                                       "train.global_batch_size=512"]))


def _stats(inputs, recompute: bool, k: int | None = None, selective: bool = False):
    return rank_stats(inputs.profile_at(1), inputs.cluster, 1, 2, 2, 8, recompute, np.array([1.0, 2.0]),
                      options=MemoryOptions(selective=selective, recompute_layers=k))


def test_k_layers_recomputed_the_rest_kept(inputs):
    profile = inputs.profile_at(1)
    col, (fwd, _) = profile.arrays, profile.times_many(np.array([1.0]))
    bounds = even_boundaries(profile, 4)   # p = 2 ranks x v = 2 chunks
    none, full = _stats(inputs, False), _stats(inputs, True)
    k = 3
    partial = _stats(inputs, True, k)
    for rank in range(2):
        kept, extra = 0.0, 0.0
        for chunk in range(2):
            start, end = bounds[chunk * 2 + rank], bounds[chunk * 2 + rank + 1]
            for layer in range(start, end):
                recomputed = layer - start < k and col["recomputable"][layer]
                kept += col["activation_bytes_recompute" if recomputed else "activation_bytes"][layer]
                extra += fwd[0, layer] if recomputed else 0.0
        assert partial.activation_bytes[:, rank] == pytest.approx([kept, 2 * kept])
        assert partial.backward[0, rank] == pytest.approx(none.backward[0, rank] + extra)
        assert full.activation_bytes[0, rank] < partial.activation_bytes[0, rank] < none.activation_bytes[0, rank]
        assert full.backward[0, rank] > partial.backward[0, rank] > none.backward[0, rank]
    zero, all_layers = _stats(inputs, True, 0), _stats(inputs, True, 10_000)
    np.testing.assert_allclose(zero.activation_bytes, none.activation_bytes)
    np.testing.assert_allclose(zero.backward, none.backward)
    np.testing.assert_allclose(all_layers.activation_bytes, full.activation_bytes)
    np.testing.assert_allclose(all_layers.backward, full.backward)


def test_selective_on_the_first_k_layers_drops_only_their_cores(inputs):
    none, selective, partial = _stats(inputs, False), _stats(inputs, False, selective=True), \
        _stats(inputs, False, 2, selective=True)
    assert (selective.activation_bytes < partial.activation_bytes).all()
    assert (partial.activation_bytes < none.activation_bytes).all()


def test_the_plan_carries_the_priced_value():
    inputs = inputs_from_config(compose(["model=gpt_1.7b", "cluster=dgx_a100", "cluster.nodes=4",
                                         "train.global_batch_size=512", "planner.recompute_num_layers=2",
                                         "planner.recompute=[true]", "planner.selective_recompute=false"]))
    plan = make_plan(inputs, "ptdp", "strict", False).plan
    assert plan.recompute == "full" and plan.recompute_layers == 2
    assert plan.to_json()["recompute_num_layers"] == 2
