"""Water filling on docs/cluster.md's own example (12 jobs on 8 V100 + 16 P100 + 24 K80, T from the
planner): the same lowest share as LAS, and no type left idle while a job that runs there waits."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from planner.cluster.__main__ import load_setup, problem_for
from planner.cluster.policies import allocate, effective_throughput, equal_share, validity_errors
from planner.config import compose

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def example():
    cfg = compose([f"jobs={ROOT / 'docs' / 'cluster_jobs.yaml'}", "fleet=gavel_physical"], config_name="gavel")
    fleet, table, jobs = load_setup(cfg)
    return problem_for(jobs, table.matrix(jobs), fleet)


def idle_while_waiting(p, X) -> list[tuple[int, int]]:
    """(type, job) pairs: GPUs of the type free (at least the job's scale) while the job, which can
    run there, has time left in its row."""
    free = p.counts - (X * p.scale[:, None]).sum(axis=0)
    waiting = X.sum(axis=1) < 1 - 1e-6
    return [(j, m) for j in range(p.shape[1]) for m in range(p.shape[0])
            if free[j] >= p.scale[m] - 1e-6 and waiting[m] and p.T[m, j] > 0]


def test_water_filling_on_the_docs_example(example):
    las = allocate("max_min_fairness", example)
    water = allocate("max_min_fairness_water_filling", example)
    assert validity_errors(water.X, example) == []
    assert water.objective == pytest.approx(las.objective, rel=1e-6)
    assert idle_while_waiting(example, water.X) == []
    assert water.lps >= 3  # at least one level, one spare-capacity LP and the final one
    # past the common minimum, LAS's leftover LP gives spare time to the largest total (ResNet-50s on
    # P100s stay at 1.2x their equal share); water filling raises the lowest shares first
    low_las, low_water = np.sort(shares(example, las.X)), np.sort(shares(example, water.X))
    first = np.flatnonzero(np.abs(low_las - low_water) > 1e-6 * low_las)[0]
    assert low_water[first] > low_las[first]


def shares(p, X) -> np.ndarray:
    equal = effective_throughput(p.T, equal_share(p))
    return p.scale / p.weights * effective_throughput(p.T, X) / equal


def _random_problem(rng: np.random.Generator):
    from planner.cluster.problem import Problem

    n, k = int(rng.integers(3, 8)), int(rng.integers(1, 4))
    T = rng.uniform(0.2, 15.0, (n, k)) * rng.choice([0.0, 1.0], p=[0.3, 0.7], size=(n, k))
    T[np.arange(n), rng.integers(0, k, n)] = rng.uniform(0.2, 15.0, n)   # every job runs somewhere
    return Problem(T, rng.integers(1, 4, k).astype(float), rng.choice([1.0, 1.0, 2.0], n), rng.uniform(0.5, 2.0, n),
                   rng.uniform(1e4, 2e6, n), np.ones(k))


def textbook_max_min_shares(p) -> np.ndarray:
    """The max-min fair shares by progressive filling, independently of the policy's code paths:
    raise the common level of the unfrozen jobs (one LP), then freeze every unfrozen job that no
    valid X lifts above the level while every job keeps at least its current floor (one LP per job)."""
    from planner.cluster.lp import AllocationLP
    from planner.cluster.problem import fair_share_weights

    a, n = fair_share_weights(p), p.shape[0]
    floor, frozen = np.zeros(n), np.zeros(n, dtype=bool)
    while not frozen.all():
        lp = AllocationLP(p, extras=1)
        lp.add(lp.per_job(-a, (~frozen).astype(float).reshape(-1, 1)), -floor * frozen * (1 - 1e-7))
        c = np.zeros(lp.size)
        c[-1] = -1.0
        level = -float(c @ lp.solve(c))
        floor = np.where(frozen, floor, level)
        for m in np.flatnonzero(~frozen):
            lp = AllocationLP(p)
            lp.add(lp.per_job(-a), -floor * (1 - 1e-7))
            weight = np.zeros(n)
            weight[m] = a[m]
            highest = -float(-lp.objective_x(weight) @ lp.solve(-lp.objective_x(weight)))
            frozen[m] = highest <= level * (1 + 1e-5)
    return floor


def test_water_filling_is_max_min_fair_on_random_instances():
    """On 10 random instances (several levels, some jobs bottlenecked early) the shares equal
    those of textbook progressive filling; LAS, which is only fair at the minimum, differs on some."""
    from planner.cluster.problem import fair_share_weights

    rng = np.random.default_rng(7)
    levels, las_differs = [], 0
    for _ in range(10):
        p = _random_problem(rng)
        alloc = allocate("max_min_fairness_water_filling", p)
        assert validity_errors(alloc.X, p) == []
        share = fair_share_weights(p) * p.throughput(alloc.X)
        expected = textbook_max_min_shares(p)
        np.testing.assert_allclose(np.sort(share), np.sort(expected), rtol=1e-5)
        las = np.sort(fair_share_weights(p) * p.throughput(allocate("max_min_fairness", p).X))
        las_differs += not np.allclose(las, np.sort(expected), rtol=1e-5)
        levels.append(len(np.unique(np.round(expected, 5))))
    assert max(levels) >= 3 and las_differs >= 1   # the instances do tell the policies apart


def test_water_filling_freezes_many_equal_jobs_in_one_round():
    """200 alike jobs on one type share it equally in one level LP (the duals show every job
    bottlenecked), not one job per round (a rise test alone would let the levels' tolerances, summed
    over the jobs, lift any one of them)."""
    from planner.cluster.problem import Problem

    n = 200
    p = Problem(np.full((n, 1), 2.0), np.array([50.0]), np.ones(n), np.ones(n), np.full(n, 1e5), np.ones(1))
    alloc = allocate("max_min_fairness_water_filling", p)
    np.testing.assert_allclose(alloc.X[:, 0], 0.25, rtol=1e-4)   # the holds' 1e-7 slack, summed, goes somewhere
    assert alloc.lps == 2   # the level and the spare-capacity LP
