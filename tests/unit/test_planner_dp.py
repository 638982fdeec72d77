"""PipeDream's hierarchical DP equals brute-force enumeration of the same recurrence on small instances."""
from __future__ import annotations

import math
import random
from functools import lru_cache

import numpy as np
import pytest

from planner import cost
from planner.errors import PlannerError
from planner.pipedream_dp import MemoryModel, check_layers, pipedream_dp, stage_memory
from tests.planner_helpers import compositions, random_cluster, random_profile, replica_splits


def brute_force(profile, cluster, b, replication, memory):
    fwd, bwd = profile.times(b)
    col = profile.arrays
    rec = col["recomputable"]
    comp = fwd + bwd + (fwd * rec if memory.recompute else 0)
    kept = np.where(rec, col["activation_bytes_recompute"], col["activation_bytes"]) if memory.recompute \
        else col["activation_bytes"]
    working = (col["activation_bytes"].max() if memory.recompute else 0.0) * b
    n = profile.num_layers
    counts = [lv.count for lv in cluster.levels]

    def fits(i, j, flight):
        if memory.limit is None:
            return True
        need = cost.device_memory(col["parameter_bytes"][i:j].sum(), col["optimizer_bytes"][i:j].sum(),
                                  cost.weight_versions("pipedream", flight), kept[i:j].sum() * b, flight,
                                  working, memory.workspace)
        return need <= memory.limit

    @lru_cache(maxsize=None)
    def best(k, i, j):
        """A^k(i -> j, m_k) by enumeration; k = -1 is the single device."""
        if k < 0:
            return float(comp[i:j].sum())
        lv = cluster.levels[k]
        m_total = counts[k]
        result = math.inf
        for stages in compositions(n, i, j):
            if len(stages) > m_total or (not replication and len(stages) != m_total):
                continue
            splits = replica_splits(m_total, len(stages)) if replication else [(1,) * len(stages)]
            for reps in splits:
                worst, before, ok = 0.0, 0, True
                for q, ((s0, s1), r) in enumerate(zip(stages, reps)):
                    if k == 0 and not fits(s0, s1, math.ceil((m_total - before) / r)):
                        ok = False
                        break
                    inner = best(k - 1, s0, s1)
                    sync = 2 * (r - 1) * col["parameter_bytes"][s0:s1].sum() / lv.bandwidth
                    worst = max(worst, max(inner, sync) / r)
                    if q > 0:
                        worst = max(worst, 2 * col["output_bytes"][s0 - 1] * b / lv.bandwidth)
                    before += r
                if ok:
                    result = min(result, worst)
        return result

    return best(len(counts) - 1, 0, n)


def flattened_value(profile, cluster, result, b):
    """Sanity: every stage of the DP's answer runs its layers on the ranks it names, once each."""
    covered = [layer for st in result.stages for layer in range(st.start, st.end)]
    ranks = sorted(r for st in result.stages for r in st.ranks)
    return covered, ranks


@pytest.mark.parametrize("seed", range(240))
def test_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    profile = random_profile(rng, n)
    cluster = random_cluster(rng, rng.choice([1, 1, 2]), max_count=3)
    replication = rng.random() < 0.75
    b = rng.choice([1, 2])
    limit = rng.choice([None, rng.uniform(5, 40)])
    memory = MemoryModel(limit, workspace=rng.uniform(0, 1), recompute=rng.random() < 0.3)
    expected = brute_force(profile, cluster, b, replication, memory)
    result = pipedream_dp(profile, cluster, b, replication, memory)
    if math.isinf(expected):
        assert result is None
        return
    assert result is not None
    assert result.time_per_input == pytest.approx(expected, rel=1e-9, abs=1e-12)
    covered, ranks = flattened_value(profile, cluster, result, b)
    assert covered == list(range(n))
    assert ranks == list(range(cluster.num_devices))
    if limit is not None and len(cluster.levels) == 1:
        assert max(stage_memory(profile, result.stages, b, memory)) <= limit + 1e-9


def test_straight_pipeline_needs_enough_layers():
    rng = random.Random(0)
    profile = random_profile(rng, 3)
    cluster = random_cluster(rng, 1)
    object.__setattr__(cluster.levels[0], "count", 4)
    with pytest.raises(PlannerError, match="straight pipeline needs a layer per device"):
        check_layers(profile, cluster, replication=False)
