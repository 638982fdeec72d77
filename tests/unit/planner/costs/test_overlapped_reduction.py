"""The planner's exposed data-parallel reduction (``exposed_grad_sync``) against the runtime's schedule
simulator fed the same reduction (``Costs.grad_reduce``, through the plan's simulator check)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from planner.check.simcheck import check_uniform
from planner.config import compose, inputs_from_config
from planner.costs.uniform import exposed_grad_sync, overlapped_reduction, rank_stats
from planner.inputs.memory_options import MemoryOptions


@pytest.fixture(scope="module")
def inputs():
    return inputs_from_config(compose(["model=gpt_1.7b", "cluster=dgx_a100", "cluster.nodes=4",
                                       "train.global_batch_size=512"]))


@pytest.mark.parametrize("bucket_mb", [25, 1000])
@pytest.mark.parametrize("backward_scale", [1.0, 0.01])   # the reduction hidden behind the last backward, or not
def test_planner_and_simulator_agree_on_the_exposed_reduction(inputs, bucket_mb, backward_scale):
    d = 8
    stats = rank_stats(inputs.profile_at(1), inputs.cluster, 1, 2, 1, d, False, np.array([1.0]),
                       options=MemoryOptions(grad_bucket_bytes=bucket_mb * 2**20))
    stats = replace(stats, backward=stats.backward * backward_scale,
                    chunk_backward=stats.chunk_backward * backward_scale)
    reduction = overlapped_reduction(stats, inputs.cluster, d)
    level = inputs.cluster.level_for_span(2 * d)
    check = check_uniform("1f1b", stats, 0, 8, level.bandwidth, level.latency, reduction)
    assert check.ran, check.note
    assert check.grad_sync_simulated == pytest.approx(check.grad_sync_formula, rel=1e-9)
    blocking = float(exposed_grad_sync(replace(stats, options=MemoryOptions()), inputs.cluster, d, None)[0])
    assert 0 < check.grad_sync_formula < blocking   # something hides, the last bucket never does
    assert check.to_json()["grad_sync_simulated_s"] == check.grad_sync_simulated


def test_a_blocking_reduction_is_not_simulated_as_overlapped(inputs):
    stats = rank_stats(inputs.profile_at(1), inputs.cluster, 1, 2, 1, 8, False, np.array([1.0]))
    assert overlapped_reduction(stats, inputs.cluster, 8) is None
    assert overlapped_reduction(replace(stats, options=MemoryOptions(grad_bucket_bytes=1.0)), inputs.cluster, 1) is None
