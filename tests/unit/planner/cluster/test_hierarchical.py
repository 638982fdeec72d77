"""Hierarchical policies (ch. 5.4.3): entities share the cluster in proportion to their weights,
within an entity by fairness or FIFO, by water filling. The first round's level is checked against
an independent dense ``scipy.optimize.linprog`` solve; FIFO's priority against an LP written here."""
from __future__ import annotations

import numpy as np
import pytest
import yaml
from scipy.optimize import linprog

from planner.cluster.__main__ import policy_of, problem_for
from planner.cluster.fleet import Fleet, GpuType, Job, entity_arrays, load_jobs
from planner.cluster.hierarchical import job_weights, normalised_share
from planner.cluster.policies import Problem, allocate, validity_errors
from planner.cluster.report import allocation_table
from planner.cluster.simulator import simulate
from planner.config import compose
from planner.errors import PlannerError
from tests.support.cluster_lp import valid_rows
from tests.unit.planner.cluster.test_water_filling import idle_while_waiting


def _problem(T, counts, entity=None, entity_weights=None, weights=None, scale=None) -> Problem:
    T = np.asarray(T, float)
    n = len(T)
    return Problem(T, np.asarray(counts, float), np.ones(n) if scale is None else np.asarray(scale, float),
                   np.ones(n) if weights is None else np.asarray(weights, float), np.full(n, 1e5), np.ones(T.shape[1]),
                   entity=None if entity is None else np.asarray(entity),
                   entity_weights=None if entity_weights is None else np.asarray(entity_weights, float))


def independent_first_level(p: Problem, w: np.ndarray) -> float:
    """max t with scale_m T_m . X_m / T_m . X^equal_m >= w_m t for every job with w_m > 0."""
    n, k = p.T.shape
    A, b, bounds = valid_rows(p, 1)
    equal = (p.T * (p.counts / p.counts.sum()) * (p.T > 0)).sum(axis=1)
    need = np.zeros((n, n * k + 1))
    for m in range(n):
        need[m, m * k:(m + 1) * k] = -p.scale[m] * p.T[m] / equal[m]
        need[m, -1] = w[m]
    keep = w > 0
    c = np.zeros(n * k + 1)
    c[-1] = -1.0
    res = linprog(c, A_ub=np.vstack([A, need[keep]]), b_ub=np.concatenate([b, np.zeros(keep.sum())]), bounds=bounds,
                  method="highs")
    assert res.status == 0
    return float(res.x[-1])


def shares(p: Problem, X: np.ndarray) -> np.ndarray:
    return normalised_share(p) * p.throughput(X)


def test_the_dissertations_example_fills_every_gpu():
    """4 identical jobs on 4 GPUs, job 1 weighing 3: it saturates at 1.0 while the others reach 1/3,
    and the next round gives them the rest (ch. 5.4.3)."""
    p = _problem(np.ones((4, 1)), [4], weights=[3, 1, 1, 1])
    for policy in ("hierarchical_fairness", "hierarchical_fifo"):
        alloc = allocate(policy, p)
        assert alloc.X[:, 0] == pytest.approx([1, 1, 1, 1], abs=1e-6)
        assert alloc.objective == pytest.approx(1 / 3, rel=1e-6)  # the first round: job 1 full, the others 1/3


def test_entity_shares_follow_the_weights():
    """Three GPUs, entity A (weight 1) with 3 jobs and B (weight 2) with 3: A holds one GPU, B two;
    by fairness each job gets its entity's part, by FIFO the earliest jobs first."""
    p = _problem(np.ones((6, 1)), [3], entity=[0, 0, 0, 1, 1, 1], entity_weights=[1, 2])
    fair = allocate("hierarchical_fairness", p).X[:, 0]
    assert fair == pytest.approx([1 / 3] * 3 + [2 / 3] * 3, abs=1e-6)
    fifo = allocate("hierarchical_fifo", p).X[:, 0]
    assert fifo == pytest.approx([1, 0, 0, 1, 1, 0], abs=1e-5)  # floors are held within 1e-6 (relative)
    for X in (fair, fifo):
        assert X[:3].sum() / X[3:].sum() == pytest.approx(1 / 2, rel=1e-5)


def test_a_saturated_entity_leaves_its_rest_to_the_others():
    """Entity A's one job can use at most one GPU whatever A's weight: water filling gives the
    three other GPUs to B rather than leaving them idle."""
    p = _problem(np.ones((3, 1)), [4], entity=[0, 1, 1], entity_weights=[5, 1])
    X = allocate("hierarchical_fairness", p).X
    assert X[:, 0] == pytest.approx([1, 1, 1], abs=1e-6)
    assert idle_while_waiting(p, X) == []


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("within", ["fairness", "fifo"])
def test_random_instances_reach_the_first_level_and_leave_nothing_idle(seed, within):
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(3, 8)), int(rng.integers(1, 4))
    T = rng.uniform(0.2, 15.0, (n, k)) * rng.choice([0.0, 1.0], p=[0.2, 0.8], size=(n, k))
    T[np.arange(n), rng.integers(0, k, n)] = rng.uniform(0.2, 15.0, n)
    entities = int(rng.integers(1, 4))
    p = _problem(T, rng.integers(1, 4, k), entity=rng.integers(0, entities, n),
                 entity_weights=rng.uniform(0.5, 3.0, entities), weights=rng.uniform(0.5, 2.0, n),
                 scale=rng.choice([1, 1, 2], n))
    alloc = allocate(f"hierarchical_{within}", p)
    assert validity_errors(alloc.X, p) == []
    w = job_weights(p, np.zeros(n, dtype=bool), within)
    assert alloc.objective == pytest.approx(independent_first_level(p, w), rel=1e-5)
    assert idle_while_waiting(p, alloc.X) == []


def test_fifo_gives_the_earliest_job_its_best_then_the_next():
    """One entity on two types: FIFO gives job 0 its fastest throughput, then job 1 the most it can
    get with job 0 held there (an LP written here), and job 2 what is left."""
    T = np.array([[2.0, 1.0], [3.0, 1.0], [1.0, 1.0]])
    p = _problem(T, [1, 1], entity=[0, 0, 0], entity_weights=[1])
    thr = p.throughput(allocate("hierarchical_fifo", p).X)
    assert thr[0] == pytest.approx(2.0, rel=1e-6)
    A, b, bounds = valid_rows(p, 0)
    hold = np.zeros((1, 6))
    hold[0, 0:2] = -T[0]
    c = np.zeros(6)
    c[2:4] = -T[1]
    res = linprog(c, A_ub=np.vstack([A, hold]), b_ub=np.concatenate([b, [-2.0]]), bounds=bounds, method="highs")
    assert thr[1] == pytest.approx(-res.fun, rel=1e-6) and thr[1] == pytest.approx(1.0, rel=1e-6)
    assert thr[2] == pytest.approx(0.0, abs=1e-6)  # both GPUs taken by the earlier jobs


def test_the_jobs_file_names_entities(tmp_path):
    path = tmp_path / "jobs.yaml"
    rows = [{"name": "a", "model": "gpt_tiny", "batch": 8, "steps": 10, "entity": "research"},
            {"name": "b", "model": "gpt_tiny", "batch": 8, "steps": 10},
            {"name": "c", "model": "gpt_tiny", "batch": 8, "steps": 10, "entity": "product", "weight": 2},
            {"name": "d", "model": "gpt_tiny", "batch": 8, "steps": 10, "entity": "research"}]
    path.write_text(yaml.safe_dump({"entities": {"product": 2, "research": 1}, "jobs": rows}))
    jobs = load_jobs(str(path))
    assert entity_arrays(jobs) == ([0, 1, 2, 0], [1.0, 1.0, 2.0])  # b: an entity of its own, its own weight
    fleet = Fleet("f", (GpuType("v100", "v100_16gb_x8", 2, 1.0),))
    p = problem_for(jobs, np.ones((4, 1)), fleet)
    assert p.entity.tolist() == [0, 1, 2, 0] and p.entity_weights.tolist() == [1.0, 1.0, 2.0]
    alloc = allocate("hierarchical_fairness", p)   # 2 GPUs: research (a, d) 1/2, b 1/2, product (c) 1
    assert alloc.X[:, 0] == pytest.approx([0.25, 0.5, 1.0, 0.25], abs=1e-5)
    assert allocation_table(jobs, fleet, p, alloc).endswith(
        "entity shares (scale x steps/s over X^equal's, summed): research (weight 1) 0.500, product (weight 2) 1.000")
    path.write_text(yaml.safe_dump({"entities": {"product": 2}, "jobs": rows}))
    with pytest.raises(PlannerError, match=r"jobs\[0\].entity = 'research' has no weight"):
        load_jobs(str(path))
    path.write_text(yaml.safe_dump({"entities": {"research": 0}, "jobs": rows[:2]}))
    with pytest.raises(PlannerError, match="entities.research = 0 must be a number > 0"):
        load_jobs(str(path))


def test_policy_hierarchical_takes_within():
    assert policy_of(compose(["policy=hierarchical"], config_name="gavel")) == "hierarchical_fairness"
    assert policy_of(compose(["policy=hierarchical", "within=fifo"], config_name="gavel")) == "hierarchical_fifo"
    with pytest.raises(PlannerError, match="within='lifo' is unknown"):
        policy_of(compose(["policy=hierarchical", "within=lifo"], config_name="gavel"))
    with pytest.raises(PlannerError, match="policy='nope' is unknown"):
        policy_of(compose(["policy=nope"], config_name="gavel"))


def test_a_trace_runs_under_the_hierarchical_policies():
    """Six single-GPU jobs of two entities arriving over an hour on 2 GPUs: every job finishes, and
    under FIFO within entities the earliest job of each finishes first."""
    fleet = Fleet("f", (GpuType("v100", "v100_16gb_x8", 2, 1.0),))
    jobs = [Job(f"j{i}", "m", 1, 3600.0, arrival_hours=0.2 * i, entity=("a", "b")[i % 2], entity_weight=(1.0, 2.0)[i % 2])
            for i in range(6)]
    T = np.ones((6, 1))
    results = {policy: simulate(jobs, T, fleet, policy, mechanism="ideal")
               for policy in ("hierarchical_fairness", "hierarchical_fifo")}
    assert all(np.all(np.isfinite(r.jct_h)) for r in results.values())
    fifo = results["hierarchical_fifo"].finish_h
    assert fifo[0] < fifo[2] < fifo[4] and fifo[1] < fifo[3] < fifo[5]
