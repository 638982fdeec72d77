"""PipeDream's hierarchical DP equals brute-force enumeration of the same recurrence on small instances."""
from __future__ import annotations

import math
import random
from dataclasses import replace
from functools import lru_cache

import numpy as np
import pytest

from planner.costs import closed_form as cost
from planner.errors import PlannerError
from planner.search.pipedream_dp import DPOptions, MemoryModel, check_layers, pipedream_dp, price_plan, stage_memory
from tests.support.planner_helpers import compositions, random_cluster, random_profile, replica_splits


def brute_force(profile, cluster, b, options, memory):
    replication = options.replication
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
        totals = range(1, m_total + 1) if options.fewer_devices else [m_total]
        below = counts[k - 1] if k else 1   # the released first stage's sync: shared by the previous level's count
        for stages in compositions(n, i, j):
            if len(stages) > m_total or (not replication and len(stages) not in totals):
                continue
            splits = [sp for u in totals for sp in replica_splits(u, len(stages))] if replication \
                else [(1,) * len(stages)]
            for reps in splits:
                worst, before, ok = 0.0, 0, True
                for q, ((s0, s1), r) in enumerate(zip(stages, reps)):
                    if k == 0 and not fits(s0, s1, math.ceil((m_total - before) / r)):
                        ok = False
                        break
                    inner = best(k - 1, s0, s1)
                    w = col["parameter_bytes"][s0:s1].sum()
                    if options.costs == "released":  # the first stage's sync is shared by a component's devices
                        sync = 4 * (r - 1) * w / (lv.bandwidth * r) / (below if q == 0 else 1)
                        worst = max(worst, (inner + sync) / r)
                        cut = 0.0  # a later stage receives its input and sends its output (not past the model's end)
                        if q > 0 and options.compression is not None:
                            out = col["output_bytes"] * b
                            cut = 2 * out[s0 - 1] / (lv.bandwidth * r) / options.compression
                            if s1 < n:
                                cut = max(cut, 2 * out[s1 - 1] / (lv.bandwidth * r) / options.compression)
                    else:
                        worst = max(worst, max(inner, 2 * (r - 1) * w / lv.bandwidth) / r)
                        cut = 2 * col["output_bytes"][s0 - 1] * b / lv.bandwidth if q > 0 else 0.0
                    worst = max(worst, cut)
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


@pytest.mark.parametrize("seed", range(300))
def test_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    profile = random_profile(rng, n)
    cluster = random_cluster(rng, rng.choice([1, 1, 2, 3]), max_count=3)
    options = DPOptions(rng.random() < 0.75, rng.random() < 0.5, rng.choice(["paper", "released"]),
                        rng.choice([None, 1.0, 2.5]))
    b = rng.choice([1, 2])
    limit = rng.choice([None, rng.uniform(5, 40)])
    memory = MemoryModel(limit, workspace=rng.uniform(0, 1), recompute=rng.random() < 0.3)
    expected = brute_force(profile, cluster, b, options, memory)
    result = pipedream_dp(profile, cluster, b, options, memory)
    if math.isinf(expected):
        assert result is None
        return
    assert result is not None
    assert result.time_per_input == pytest.approx(expected, rel=1e-9, abs=1e-12)
    if limit is None:   # the plan priced on its own is what the DP reported (plan pricing ignores memory)
        plan = [(st.start, st.end, st.replicas) for st in result.stages]
        assert price_plan(profile, cluster, b, plan, options, memory.recompute) == pytest.approx(
            result.time_per_input, rel=1e-9, abs=1e-12)
    covered, ranks = flattened_value(profile, cluster, result, b)
    assert covered == list(range(n))
    assert ranks == list(range(len(ranks)))  # dense, whatever the number used
    if not options.fewer_devices:
        assert len(ranks) == cluster.num_devices
    if limit is not None and len(cluster.levels) == 1:
        assert max(stage_memory(profile, result.stages, b, memory)) <= limit + 1e-9


def test_straight_pipeline_needs_enough_layers():
    rng = random.Random(0)
    profile = random_profile(rng, 3)
    cluster = random_cluster(rng, 1)
    object.__setattr__(cluster.levels[0], "count", 4)
    with pytest.raises(PlannerError, match="straight pipeline needs a layer per device: 3 layers < 4 devices"):
        check_layers(profile, cluster, DPOptions(replication=False, fewer_devices=False))
    check_layers(profile, cluster, DPOptions(replication=False))  # fewer devices: three of the four


def test_fewer_devices_leave_idle_layers_alone():
    """A layer that does no work is never replicated just to use every device (--use_fewer_machines)."""
    rng = random.Random(3)
    profile = random_profile(rng, 3)
    layers = list(profile.layers)
    layers[2] = replace(layers[2], forward_s=(0.0, 0.0), backward_s=(0.0, 0.0), parameter_bytes=0.0)
    profile = replace(profile, layers=tuple(layers))
    cluster = random_cluster(rng, 1)
    object.__setattr__(cluster.levels[0], "count", 12)
    every = pipedream_dp(profile, cluster, 1, DPOptions(fewer_devices=False))
    fewer = pipedream_dp(profile, cluster, 1, DPOptions())
    assert fewer.time_per_input == pytest.approx(every.time_per_input)
    assert sum(st.replicas for st in every.stages) == 12
    assert all(st.replicas == 1 for st in fewer.stages if st.start == 2)


@pytest.mark.parametrize("seed", range(60))
def test_no_plan_is_priced_below_the_optimum(seed):
    """Any plan of the right devices, priced on its own, costs at least the DP's optimum; a plan that
    cannot be laid on the topology (a stage's replicas spread unevenly over components) costs inf."""
    rng = random.Random(1000 + seed)
    n = rng.randint(2, 6)
    profile = random_profile(rng, n)
    cluster = random_cluster(rng, rng.choice([1, 2]), max_count=3)
    options = DPOptions(True, rng.random() < 0.5, rng.choice(["paper", "released"]), rng.choice([None, 1.0]))
    best = pipedream_dp(profile, cluster, 1, options, MemoryModel(None))
    devices = cluster.num_devices
    for stages in compositions(n, 0, n):
        if len(stages) > devices:
            continue
        for reps in replica_splits(devices, len(stages)):
            price = price_plan(profile, cluster, 1, [(a, b, r) for (a, b), r in zip(stages, reps)], options)
            assert price >= best.time_per_input * (1 - 1e-9)


def test_a_plan_that_splits_a_replica_across_servers_has_no_price():
    rng = random.Random(5)
    profile = random_profile(rng, 3)
    cluster = random_cluster(rng, 2)
    object.__setattr__(cluster.levels[0], "count", 2)
    object.__setattr__(cluster.levels[1], "count", 2)
    options = DPOptions(fewer_devices=False)
    assert math.isinf(price_plan(profile, cluster, 1, [(0, 1, 3), (1, 3, 1)], options))  # 3 + 1 on 2 x 2
    assert math.isfinite(price_plan(profile, cluster, 1, [(0, 1, 2), (1, 3, 2)], options))
    assert math.isinf(price_plan(profile, cluster, 1, [(0, 2, 2), (1, 3, 2)], options))   # overlapping layers
