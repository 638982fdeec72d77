"""Space sharing (ch. 5.3.1): X over job combinations (each job alone, then pairs), a job's throughput
summed over the combinations it is in, per-type capacity over combinations. Valid allocations,
the optimum of an independent LP over the same combinations, never worse than without pairs, and a
simulated trace whose average JCT drops with pairs."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import linprog

from planner.cluster.colocation import Colocation, colocation_from
from planner.cluster.fleet import Fleet, GpuType, Job
from planner.cluster.mechanism import RoundMechanism
from planner.cluster.policies import POLICIES, Problem, allocate, objective_value, validity_errors
from planner.cluster.simulator import simulate
from planner.errors import PlannerError


def paired(rng: np.random.Generator, n: int, k: int = 3) -> Problem:
    """Random jobs (some unable to run on a type, a few on 2 GPUs) and random pairs of equal scale,
    each member keeping 30-90% of its own throughput when paired."""
    T = rng.uniform(0.5, 20.0, (n, k)) * rng.choice([0.0, 1.0], p=[0.15, 0.85], size=(n, k))
    T[np.arange(n), rng.integers(0, k, n)] = rng.uniform(0.5, 20.0, n)
    scale = rng.choice([1, 1, 1, 2], n)
    pairs = [(a, b) for a in range(n) for b in range(a + 1, n) if scale[a] == scale[b] and rng.random() < 0.5]
    pairs = np.array(pairs or [(0, 0)], dtype=int)[: max(len(pairs), 0)].reshape(-1, 2)
    pair_T = np.stack([T[pairs[:, 0]], T[pairs[:, 1]]], axis=2) * rng.uniform(0.3, 0.9, (len(pairs), k, 2))
    steps = rng.uniform(1e4, 1e6, n)
    return Problem(T, rng.integers(1, 5, k).astype(float), scale.astype(float), rng.uniform(0.5, 2, n), steps,
                   rng.uniform(0.3, 3.0, k), elapsed_s=rng.uniform(0, 1e4, n), isolated_s=rng.uniform(0, 1e4, n),
                   deadline_s=np.where(rng.random(n) < 0.5, steps / T.max(axis=1) * rng.uniform(1, 10, n), np.inf),
                   pairs=pairs if len(pairs) else None, pair_T=pair_T if len(pairs) else None)


def without_pairs(p: Problem) -> Problem:
    return Problem(p.T, p.counts, p.scale, p.weights, p.steps, p.prices, p.elapsed_s, p.isolated_s, p.deadline_s)


@pytest.mark.parametrize("policy", POLICIES)
def test_allocations_over_combinations_are_valid_and_never_worse(policy):
    rng = np.random.default_rng(30 + POLICIES.index(policy))
    for _ in range(6):
        p = paired(rng, int(rng.integers(2, 9)))
        alloc = allocate(policy, p)
        assert validity_errors(alloc.X, p) == [], (policy, validity_errors(alloc.X, p))
        assert objective_value(policy, p, alloc.X) == alloc.objective
        if policy in ("sjf", "finish_time_fairness"):  # greedy / bisection: no optimality claim to compare
            continue
        alone = allocate(policy, without_pairs(p))  # feasible with pairs too, so pairs never do worse
        assert alloc.objective >= alone.objective - 1e-6 * max(1.0, abs(alone.objective)), policy


def independent_combination_lp(p: Problem, policy: str) -> float:
    """Written out densely: one variable per (combination, type), a job's throughput summed over the
    combinations holding it; max_throughput (sum of normalised throughputs) or max_min_fairness
    (max t, t <= scale_m / w_m throughput_m / throughput_m(X^equal))."""
    n, k = p.T.shape
    combos = [(m,) for m in range(n)] + [tuple(pr) for pr in p.pairs]
    R = len(combos)
    rate = np.zeros((n, R, k))
    for r, members in enumerate(combos):
        for pos, m in enumerate(members):
            rate[m, r] = p.T[m] if len(members) == 1 else p.pair_T[r - n, :, pos] * (p.pair_T[r - n] > 0).all(axis=1)
    thr = rate.reshape(n, R * k)
    A = [np.array([[float(m in members) for members in combos for _ in range(k)] for m in range(n)])]
    A.append(np.array([[p.scale[members[0]] * (j == jj) for members in combos for j in range(k)] for jj in range(k)]))
    b = [np.ones(n), p.counts]
    bounds = [(0.0, 1.0 if rate[:, r, j].min(initial=np.inf) >= 0 and (rate[list(combos[r]), r, j] > 0).all() else 0.0)
              for r in range(R) for j in range(k)]
    best = p.T.max(axis=1)
    if policy == "max_throughput":
        res = linprog(-(thr / best[:, None]).sum(axis=0), A_ub=np.vstack(A), b_ub=np.concatenate(b), bounds=bounds,
                      method="highs")
        return -res.fun
    equal = (p.T * (p.counts / p.counts.sum()) * (p.T > 0)).sum(axis=1)
    share = thr * (p.scale / (p.weights * equal))[:, None]
    A_all = np.vstack([np.hstack([a, np.zeros((len(a), 1))]) for a in A] + [np.hstack([-share, np.ones((n, 1))])])
    c = np.zeros(R * k + 1)
    c[-1] = -1.0
    res = linprog(c, A_ub=A_all, b_ub=np.concatenate(b + [np.zeros(n)]), bounds=bounds + [(None, None)], method="highs")
    return -res.fun


@pytest.mark.parametrize("policy", ["max_throughput", "max_min_fairness"])
def test_space_sharing_reaches_an_independent_optimum(policy):
    rng = np.random.default_rng(41)
    for _ in range(20):
        p = paired(rng, int(rng.integers(2, 7)))
        if not p.num_pairs:
            continue
        assert allocate(policy, p).objective == pytest.approx(independent_combination_lp(p, policy), rel=1e-6)


def test_the_papers_pair_on_one_v100():
    """One V100, jobs of 40 and 15 steps/s alone; paired they keep 30 and 10 (0.75 + 0.67 of their
    own): maximum throughput runs the pair all the time, 1.417 normalised against 1 for either alone."""
    p = Problem(np.array([[40.0], [15.0]]), np.array([1.0]), np.ones(2), np.ones(2), np.full(2, 1e5), np.ones(1),
                pairs=np.array([[0, 1]]), pair_T=np.array([[[30.0, 10.0]]]))
    alloc = allocate("max_throughput", p)
    assert alloc.X[:, 0] == pytest.approx([0, 0, 1], abs=1e-7)
    assert alloc.objective == pytest.approx(30 / 40 + 10 / 15)


def test_mechanism_runs_a_job_in_one_combination_per_round():
    mech = RoundMechanism([2])
    mech.reset(np.array([[0.5], [0.5], [0.5], [0.5]]))  # jobs 0, 1, 2 alone, then the pair (0, 1)
    members = [(0,), (1,), (2,), (0, 1)]
    for _ in range(20):
        chosen = mech.schedule([1, 1, 1, 1], members)
        jobs = [m for r, _ in chosen for m in members[r]]
        assert len(jobs) == len(set(jobs))
        mech.record(chosen)


def test_space_sharing_lowers_average_jct_on_a_trace():
    """Sixteen single-GPU jobs on 2 fast + 2 slow GPUs: with pairs keeping 70% each, a shared GPU does
    1.4x the work, so queued jobs start sooner and the average JCT drops."""
    rng = np.random.default_rng(8)
    n = 16
    fleet = Fleet("tiny", (GpuType("fast", "v100_16gb_x8", 2, 2.0), GpuType("slow", "k80_x8", 2, 0.5)))
    T = rng.uniform(1, 10, (n, 2)) * np.array([3.0, 1.0])
    jobs = [Job(f"j{i}", "m", 1, float(T[i, 0] * 3600 * rng.uniform(0.5, 3)), arrival_hours=0.25 * i) for i in range(n)]
    colocation = colocation_from([], 0.7, jobs, T, fleet)
    alone = simulate(jobs, T, fleet, "max_min_fairness")
    shared = simulate(jobs, T, fleet, "max_min_fairness", colocation=colocation)
    assert np.all(np.isfinite(shared.jct_h))
    assert np.mean(shared.jct_h) < 0.95 * np.mean(alone.jct_h)
    assert np.all(shared.busy_gpu_h <= shared.horizon_h * np.array([2, 2]) + 1e-9)


def test_colocated_table_and_its_mistakes():
    fleet = Fleet("f", (GpuType("v100", "v100_16gb_x8", 1, 2.0),))
    jobs = [Job("a", "m", 1, 1e4), Job("b", "m", 1, 1e4), Job("c", "m", 1, 1e4, scale_factor=2)]
    T = np.ones((3, 1))
    c = colocation_from([{"jobs": ["a", "b"], "throughput": {"v100": [0.6, 0.7]}}], None, jobs, T, fleet)
    pairs, rates = c.among(np.array([1, 0]))
    assert pairs.tolist() == [[1, 0]] and rates.tolist() == [[[0.6, 0.7]]]
    assert c.among(np.array([0, 2])) == (None, None)
    for rows, message in [([{"jobs": ["a"]}], "must name two different jobs"),
                          ([{"jobs": ["a", "z"]}], "names jobs ['z']"),
                          ([{"jobs": ["a", "c"]}], "both must ask for as many"),
                          ([{"jobs": ["a", "b"], "throughput": {"k80": [1, 1]}}], "names type 'k80'"),
                          ([{"jobs": ["a", "b"], "throughput": {"v100": [1]}}], "must be two numbers")]:
        with pytest.raises(PlannerError, match=message.replace("[", r"\[").replace("]", r"\]")):
            colocation_from(rows, None, jobs, T, fleet)
    with pytest.raises(PlannerError, match="colocation_factor"):
        colocation_from([], 1.5, jobs, T, fleet)
    assert isinstance(colocation_from([], 0.5, jobs, T, fleet), Colocation)


def test_the_estimate_pairs_jobs_only_where_both_fit_memory():
    """colocation_factor pairs two single-GPU jobs on a type only where their plans' memory fits one
    GPU together; a pair that fits nowhere is no pair."""
    fleet = Fleet("f", (GpuType("big", "v100_16gb_x8", 1, 2.0), GpuType("small", "k80_x8", 1, 0.5)))
    jobs = [Job("a", "m", 1, 1e4), Job("b", "m", 1, 1e4), Job("c", "m", 1, 1e4)]
    T = np.array([[4.0, 2.0], [6.0, 3.0], [8.0, 1.0]])
    need = np.array([[3.0, 3.0], [5.0, 5.0], [9.0, 9.0]])   # bytes, in units of a GiB here
    c = colocation_from([], 0.5, jobs, T, fleet, (need, np.array([10.0, 8.0])))
    pairs, rates = c.among(np.arange(3))
    assert pairs.tolist() == [[0, 1]]   # a+b: 8 fits big (10) and small (8); a+c, b+c: 12 and 14 fit neither
    assert rates.tolist() == [[[2.0, 3.0], [1.0, 1.5]]]
    c = colocation_from([], 0.5, jobs, T, fleet, (need, np.array([12.0, 8.0])))
    assert c.among(np.arange(3))[1][1].tolist() == [[2.0, 4.0], [0.0, 0.0]]   # a+c on the big type only


def test_the_table_gives_each_plans_memory_less_the_reserve():
    from planner.cluster.throughput import ThroughputTable

    fleet = Fleet("f", (GpuType("v100", "v100_16gb_x8", 2, 2.0),))
    table = ThroughputTable(fleet)
    jobs = [Job("r", "resnet50", 32, 1e4), Job("m", "mlp", 8, 1e4, throughput={"v100": 5.0})]
    need, usable = table.memory(jobs)
    gib = 2**30
    assert usable.tolist() == [pytest.approx(16 * gib - (3 * gib + 0.2 * 16 * gib))]   # the GPU reserve: 3 GiB + 20%
    assert 1 * gib < need[0, 0] < usable[0] and need[1, 0] == 0.0   # a measured job has no plan: unknown, 0
