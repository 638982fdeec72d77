"""Gavel's policies reach their LP optimum: each policy's objective, evaluated on its allocation,
equals an independent ``scipy.optimize.linprog`` solve of the same problem written here (dense
matrices, another scaling). A two-stage policy (makespan, max-min fairness) must keep its first
LP's optimum in the second within a relative tolerance, however small the optimum is in its units."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import linprog

from planner.cluster.policies import Problem, allocate, effective_throughput, equal_share, objective_value

REL = 1e-6


def _problem(T, counts, scale, weights, steps, prices) -> Problem:
    return Problem(np.asarray(T, float), np.asarray(counts, float), np.asarray(scale, float),
                   np.asarray(weights, float), np.asarray(steps, float), np.asarray(prices, float))


def _random(rng: np.random.Generator) -> Problem:
    n, k = int(rng.integers(2, 7)), int(rng.integers(1, 4))
    T = rng.uniform(0.2, 15.0, (n, k)) * rng.choice([0.0, 1.0], p=[0.2, 0.8], size=(n, k))
    T[np.arange(n), rng.integers(0, k, n)] = rng.uniform(0.2, 15.0, n)  # every job runs somewhere
    return _problem(T, rng.integers(1, 5, k), rng.choice([1, 1, 2], n), rng.uniform(0.5, 2.0, n),
                    rng.uniform(1e4, 2e6, n), rng.uniform(0.3, 3.0, k))


def _valid_rows(p: Problem, extras: int):
    """Dense A_ub, b_ub and bounds for X's validity (row sums <= 1, type capacities), plus extras."""
    n, k = p.T.shape
    rows = np.zeros((n, n * k + extras))
    for m in range(n):
        rows[m, m * k:(m + 1) * k] = 1.0
    caps = np.zeros((k, n * k + extras))
    for j in range(k):
        caps[j, j:n * k:k] = p.scale
    bounds = [(0.0, 1.0 if t > 0 else 0.0) for t in p.T.ravel()] + [(None, None)] * extras
    return np.vstack([rows, caps]), np.concatenate([np.ones(n), p.counts]), bounds


def _throughput_rows(p: Problem, coeff: np.ndarray, extras: int) -> np.ndarray:
    n, k = p.T.shape
    out = np.zeros((n, n * k + extras))
    for m in range(n):
        out[m, m * k:(m + 1) * k] = coeff[m]
    return out


def independent_makespan(p: Problem) -> float:
    """max y with T_m . X_m >= (steps_m / max steps) y; the makespan is max steps / y."""
    n, k = p.T.shape
    A, b, bounds = _valid_rows(p, 1)
    need = _throughput_rows(p, -p.T, 1)
    need[:, -1] = p.steps / p.steps.max()
    c = np.zeros(n * k + 1)
    c[-1] = -1.0
    res = linprog(c, A_ub=np.vstack([A, need]), b_ub=np.concatenate([b, np.zeros(n)]), bounds=bounds, method="highs")
    assert res.status == 0
    return -p.steps.max() / res.x[-1]  # objective_value's sign: higher is better


def independent_max_min(p: Problem) -> float:
    """max t with t <= scale_m / w_m * T_m . X_m / T_m . X^equal_m."""
    n, k = p.T.shape
    A, b, bounds = _valid_rows(p, 1)
    equal = effective_throughput(p.T, equal_share(p))
    share = _throughput_rows(p, -p.T * (p.scale / (p.weights * equal))[:, None], 1)
    share[:, -1] = 1.0
    c = np.zeros(n * k + 1)
    c[-1] = -1.0
    res = linprog(c, A_ub=np.vstack([A, share]), b_ub=np.concatenate([b, np.zeros(n)]), bounds=bounds, method="highs")
    assert res.status == 0
    return res.x[-1]


def independent_linear(p: Problem, coeff: np.ndarray) -> float:
    """max sum coeff * X over valid X (fifo, max_throughput, min_cost are each one such LP)."""
    A, b, bounds = _valid_rows(p, 0)
    res = linprog(-coeff.ravel(), A_ub=A, b_ub=b, bounds=bounds, method="highs")
    assert res.status == 0
    return -res.fun


def independent(policy: str, p: Problem) -> float:
    best = p.T.max(axis=1)
    n = p.T.shape[0]
    if policy == "makespan":
        return independent_makespan(p)
    if policy == "max_min_fairness":
        return independent_max_min(p)
    if policy == "fifo":
        return independent_linear(p, p.T * ((n - np.arange(n)) / best)[:, None])
    if policy == "max_throughput":
        return independent_linear(p, p.T / best[:, None])
    assert policy == "min_cost"
    return independent_linear(p, p.T / best[:, None] / (p.prices[None, :] * p.scale[:, None]))


def test_makespan_example_reaches_the_optimum():
    """One V100, one P100, one K80: each job alone on its own type finishes all three in 600,000 s."""
    p = _problem([[3, 1, 1], [12, 4, 2], [1, 1, 1]], [1, 1, 1], [1, 1, 1], [1, 1, 1], [8e5, 4e5, 6e5], [1, 1, 1])
    alloc = allocate("makespan", p)
    assert -alloc.objective == pytest.approx(600_000.0, rel=REL)
    assert -independent_makespan(p) == pytest.approx(600_000.0, rel=REL)


@pytest.mark.parametrize("policy", ["makespan", "max_min_fairness", "fifo", "max_throughput", "min_cost"])
def test_policy_objective_equals_an_independent_solve(policy):
    rng = np.random.default_rng(11)
    for _ in range(25):
        p = _random(rng)
        alloc = allocate(policy, p)
        expected = independent(policy, p)
        assert alloc.objective == pytest.approx(expected, rel=REL), (policy, p.T, p.counts, p.steps)
        assert objective_value(policy, p, alloc.X) == alloc.objective
