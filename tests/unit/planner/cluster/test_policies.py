"""Gavel's policies (planner/cluster/policies.py): valid allocations, hand-checkable optima, aware never
worse than agnostic on its own objective, and the round mechanism realising X."""
from __future__ import annotations

import numpy as np
import pytest

from planner.cluster.mechanism import RoundMechanism
from planner.cluster.policies import (POLICIES, Problem, allocate, effective_throughput, equal_share,
                                      objective_value, validity_errors)
from planner.errors import PlannerError


def problem(T, counts, scale=None, weights=None, steps=None, prices=None, **kw) -> Problem:
    T = np.asarray(T, dtype=float)
    n, k = T.shape
    return Problem(T, np.asarray(counts), np.ones(n, int) if scale is None else np.asarray(scale),
                   np.ones(n) if weights is None else np.asarray(weights, dtype=float),
                   np.full(n, 1e4) if steps is None else np.asarray(steps, dtype=float),
                   np.linspace(2.5, 0.5, k) if prices is None else np.asarray(prices, dtype=float), **kw)


def random_problem(rng: np.random.Generator, n: int, k: int = 3) -> Problem:
    """Jobs with different speed-ups per type, some unable to run on a type, multi-GPU jobs, SLOs."""
    T = rng.uniform(0.5, 20.0, (n, k)) * rng.choice([0.0, 1.0], p=[0.1, 0.9], size=(n, k))
    T[np.arange(n), rng.integers(0, k, n)] = rng.uniform(0.5, 20.0, n)  # every job runs somewhere
    steps = rng.uniform(1e3, 1e6, n)
    return problem(T, rng.integers(1, 9, k), scale=rng.choice([1, 1, 1, 2, 4], n), weights=rng.uniform(0.5, 2, n),
                   steps=steps, prices=rng.uniform(0.3, 3.0, k), elapsed_s=rng.uniform(0, 1e4, n),
                   isolated_s=rng.uniform(0, 1e4, n),
                   deadline_s=np.where(rng.random(n) < 0.5, steps / T.max(axis=1) * rng.uniform(1, 20, n), np.inf))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("heterogeneity", ["aware", "agnostic"])
def test_every_allocation_is_valid(policy, heterogeneity):
    rng = np.random.default_rng(2 * POLICIES.index(policy) + (heterogeneity == "agnostic"))
    for _ in range(8):
        p = random_problem(rng, int(rng.integers(1, 25)))
        alloc = allocate(policy, p, heterogeneity)
        assert validity_errors(alloc.X, p) == [], (policy, heterogeneity, validity_errors(alloc.X, p))


def test_the_papers_three_job_example():
    """Ch. 5.4.1: T = (40, 10; 12, 4; 100, 50), 1 V100 + 1 K80 -> X^het = (0.45, 0; 0.45, 0.09; 0.09, 0.91),
    about 10% above the isolated allocation (1/3 of each GPU each)."""
    p = problem([[40, 10], [12, 4], [100, 50]], [1, 1])
    alloc = allocate("max_min_fairness", p)
    np.testing.assert_allclose(alloc.X, [[0.45, 0.0], [0.45, 0.09], [0.09, 0.91]], atol=0.01)
    isolated = np.full((3, 2), 1 / 3)
    gain = alloc.objective / objective_value("max_min_fairness", p, isolated)
    assert 1.08 < gain < 1.10  # 0.7273 vs 0.6667
    assert allocate("max_min_fairness", p, "agnostic").X == pytest.approx(isolated)


def test_two_jobs_two_types_max_min_fairness():
    """Job A runs 3x faster on the fast GPU, job B equally on both; one GPU of each. B's normalised
    throughput is 1 whatever it gets (its row is at most 1), so the optimum is min = 1, and using the
    leftover the fast GPU goes to A: X = (1, 0; 0, 1), A at 3 / 2 = 1.5 of its equal share."""
    p = problem([[3, 1], [1, 1]], [1, 1])
    alloc = allocate("max_min_fairness", p)
    assert alloc.objective == pytest.approx(1.0)
    np.testing.assert_allclose(alloc.X, [[1, 0], [0, 1]], atol=1e-6)
    norm = effective_throughput(p.T, alloc.X) / effective_throughput(p.T, equal_share(p))
    np.testing.assert_allclose(norm, [1.5, 1.0])


def test_weights_and_scale_factors_in_fairness():
    """Two identical jobs on 1 GPU, weights 3 and 1: time splits 3:1. A 2-GPU job beside a 1-GPU job
    on 2 GPUs: the objective scales by the GPUs a job holds (2 X_0 vs X_1), so the 1-GPU job runs
    all the time and the 2-GPU job half of it (2 x 0.5 + 1 = 2 GPUs)."""
    weighted = allocate("max_min_fairness", problem([[1], [1]], [1], weights=[3, 1]))
    np.testing.assert_allclose(weighted.X[:, 0], [0.75, 0.25], atol=1e-6)
    scaled = allocate("max_min_fairness", problem([[1], [1]], [2], scale=[2, 1]))
    np.testing.assert_allclose(scaled.X[:, 0], [0.5, 1.0], atol=1e-6)


def test_makespan_hand_checked():
    """A fast and a slow GPU; A does 2 / 1 steps per s on them, B 1 / 1; 100 steps each. B's row is at
    most 1 at 1 step/s, so no allocation finishes B before 100 s; A alone on the fast GPU (50 s) and
    B on the slow one reach it: makespan 100 s."""
    p = problem([[2, 1], [1, 1]], [1, 1], steps=[100, 100])
    alloc = allocate("makespan", p)
    assert -alloc.objective == pytest.approx(100.0, rel=1e-6)
    assert np.all(p.steps / effective_throughput(p.T, alloc.X) <= 100.0 * (1 + 1e-6))


def test_fifo_serves_the_first_job_first():
    """Three jobs, one fast GPU and one slow: the first two get a GPU each, the first the fast one
    (it gains most relative to its best), the third waits."""
    alloc = allocate("fifo", problem([[4, 1], [4, 1], [4, 1]], [1, 1]))
    np.testing.assert_allclose(alloc.X, [[1, 0], [0, 1], [0, 0]], atol=1e-6)


def test_min_cost_prefers_cheap_throughput_and_slo_buys_speed():
    """A job 1.2x faster on a GPU 5x dearer runs on the cheap one; with a deadline the cheap one
    cannot meet, min_cost_slo buys just enough fast time (0.5 of it here)."""
    T, prices = [[12.0, 10.0]], [2.5, 0.5]
    cheap = allocate("min_cost", problem(T, [1, 1], prices=prices, steps=[1100]))
    np.testing.assert_allclose(cheap.X, [[0, 1]], atol=1e-6)
    slo = allocate("min_cost_slo", problem(T, [1, 1], prices=prices, steps=[1100], deadline_s=np.array([100.0])))
    assert effective_throughput(np.array(T), slo.X)[0] == pytest.approx(11.0, rel=1e-6)
    np.testing.assert_allclose(slo.X, [[0.5, 0.5]], atol=1e-6)


@pytest.mark.parametrize("policy", POLICIES)
def test_aware_never_worse_than_agnostic_on_its_objective(policy):
    """The agnostic allocation is feasible for the aware LP, so the aware optimum is at least as good
    (finish-time fairness: up to its bisection tolerance)."""
    rng = np.random.default_rng(7 + POLICIES.index(policy))
    for _ in range(5 if policy in ("finish_time_fairness", "max_min_fairness_water_filling") else 15):  # many LPs each
        p = random_problem(rng, int(rng.integers(2, 30)))
        aware, agnostic = allocate(policy, p, "aware"), allocate(policy, p, "agnostic")
        slack = 2e-3 * abs(agnostic.objective) if policy == "finish_time_fairness" else 1e-6 * max(1, abs(agnostic.objective))
        assert aware.objective >= agnostic.objective - slack, (policy, aware.objective, agnostic.objective)


def test_min_cost_slo_meets_slos_at_least_as_often_as_agnostic():
    rng = np.random.default_rng(3)
    for _ in range(10):
        p = random_problem(rng, 12)
        def met(X):
            need = p.steps / p.deadline_s
            return int(np.sum(effective_throughput(p.T, X) >= need * (1 - 1e-6)))
        assert met(allocate("min_cost_slo", p).X) >= met(allocate("min_cost_slo", p, "agnostic").X)


def test_unknown_policy_is_one_line():
    with pytest.raises(PlannerError, match="policy='nope' is unknown: choose one of max_min_fairness"):
        allocate("nope", problem([[1]], [1]))
    with pytest.raises(PlannerError, match="heterogeneity='x' is unknown"):
        allocate("fifo", problem([[1]], [1]), "x")


def test_mechanism_realises_the_papers_example_allocation():
    """X^example of ch. 5.3.1 on one V100, one P100, one K80: the fraction of rounds each job runs on
    each type converges to X."""
    X = np.array([[0.6, 0.4, 0.0], [0.2, 0.6, 0.2], [0.2, 0.0, 0.8]])
    mech = RoundMechanism([1, 1, 1])
    mech.reset(X)
    for _ in range(500):
        mech.record(mech.schedule([1, 1, 1]))
    np.testing.assert_allclose(mech.realised(), X, atol=0.01)


def test_mechanism_converges_to_policy_allocations():
    """Random max-min-fair allocations of single-GPU jobs (the paper's single-GPU trace, Fig. 5.15b):
    after 2000 rounds every realised fraction is within 0.02 of X, and rounds never overbook a type."""
    rng = np.random.default_rng(11)
    for _ in range(3):
        n = int(rng.integers(5, 30))
        p = problem(rng.uniform(1, 10, (n, 3)), rng.integers(1, 8, 3))
        X = allocate("max_min_fairness", p).X
        mech = RoundMechanism(p.counts)
        mech.reset(X)
        for _ in range(2000):
            chosen = mech.schedule(p.scale)
            per_type = np.bincount([j for _, j in chosen], minlength=3)
            assert np.all(per_type <= p.counts)
            mech.record(chosen)
        assert np.abs(mech.realised() - X).max() < 0.02
