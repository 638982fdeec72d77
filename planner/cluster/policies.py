"""Gavel's scheduling policies as linear programs over the allocation X (dissertation ch. 5.3-5.4, 6.4).

X[m, j] is the fraction of time job m spends on type j until the next re-solve; its *effective
throughput* is sum_j T[m, j] X[m, j]. Every policy keeps X valid (eqs. 5.1-5.3): 0 <= X <= 1, each
row sums to at most 1, and sum_m X[m, j] scale_factor[m] <= GPUs of type j; X[m, j] = 0 where the
job cannot run (T = 0). The LPs are solved by HiGHS through ``scipy.optimize.linprog``.

Heterogeneity-agnostic variants (Gavel's baselines) solve the same problem with T replaced by a
row-constant matrix: each job's throughput averaged over the GPUs it can run on, so every type
looks alike (Gavel's agnostic LAS sets every throughput to 1, which gives the same objective). An
agnostic scheduler runs a job on whichever GPU is free, so its time spreads over the types it can
run on in proportion to their GPU counts: the agnostic LPs add X[m, j] / W_j = X[m, j'] / W_j'.
(Left to the solver, the split would be an arbitrary vertex that may keep one job on K80s for
good.) The realised throughput always comes from the true T.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from planner.cluster.lp import KEEP_REL_TOL, AllocationLP
from planner.cluster.problem import (Problem, agnostic_T, best_throughput, effective_throughput, equal_share,  # noqa: F401
                                     fair_share_weights, isolated_share, validity_errors)
from planner.cluster.hierarchical import first_level, hierarchical_fairness, hierarchical_fifo
from planner.cluster.water_filling import max_min_fairness_water_filling
from planner.errors import PlannerError

POLICIES = ("max_min_fairness", "max_min_fairness_water_filling", "fifo", "makespan", "finish_time_fairness",
            "min_cost", "min_cost_slo", "max_throughput", "sjf", "hierarchical_fairness", "hierarchical_fifo")
SLO_PENALTY = 1e3  # per unit of missed SLO throughput (relative): meeting SLOs beats any saving


@dataclass
class Allocation:
    X: np.ndarray
    policy: str
    heterogeneity: str
    objective: float  # the policy's own objective, evaluated with the true T (see objective_value)
    solve_s: float
    lps: int
    notes: list[str] = field(default_factory=list)


def _use_leftovers(lp: AllocationLP, v: np.ndarray, keep: np.ndarray, keep_at: float, norm: np.ndarray) -> np.ndarray:
    """Second LP: hold the first one's objective (``keep`` . v <= ``keep_at``, a minimisation) and raise
    the total normalised throughput, so no GPU stays idle that could still speed a job up. The slack is
    relative to the optimum (the row is divided by it): an absolute one would dwarf small objectives."""
    from scipy import sparse

    scale = abs(keep_at)
    if scale == 0.0:  # an optimum of 0: nothing to be relative to, hold it at 0 (up to the tolerance)
        scale = 1.0
    lp.add(sparse.csr_matrix(keep.reshape(1, -1) / scale), [keep_at / scale + KEEP_REL_TOL])
    return lp.solve(-lp.objective_x(1.0 / norm))


def max_min_fairness(p: Problem) -> tuple[np.ndarray, int]:
    """Maximise min_m scale_m / w_m * throughput(m, X) / throughput(m, X^equal) (ch. 5.4.1, LAS)."""
    lp = AllocationLP(p, extras=1)
    a = fair_share_weights(p)
    lp.add(lp.per_job(-a, np.ones((p.shape[0], 1))), np.zeros(p.shape[0]))  # t - a_m . X_m <= 0
    c = np.zeros(lp.size)
    c[-1] = -1.0
    v = lp.solve(c)
    return lp.X(_use_leftovers(lp, v, c, float(c @ v), best_throughput(p))), 2


def fifo(p: Problem) -> tuple[np.ndarray, int]:
    """Maximise sum_m (M - m) throughput(m, X) / throughput(m, X^fastest), jobs in arrival order."""
    lp = AllocationLP(p)
    rank = p.shape[0] - np.arange(p.shape[0])
    return lp.X(lp.solve(-lp.objective_x(rank / best_throughput(p)))), 1


def makespan(p: Problem) -> tuple[np.ndarray, int]:
    """Minimise max_m steps_m / throughput(m, X): maximise z with throughput(m, X) >= steps_m z. Rows
    are scaled so z is of order 1 (z = D / makespan, D the longest time any job needs alone on its
    fastest type) rather than 1 / makespan, which is tiny in seconds."""
    lp = AllocationLP(p, extras=1)
    best = best_throughput(p)
    alone = p.steps / best
    lp.add(lp.per_job(-1.0 / best, (alone / max(float(alone.max()), 1e-300)).reshape(-1, 1)),
           np.zeros(p.shape[0]))
    c = np.zeros(lp.size)
    c[-1] = -1.0
    v = lp.solve(c)
    return lp.X(_use_leftovers(lp, v, c, float(c @ v), best_throughput(p))), 2


def finish_time_fairness(p: Problem, rel_tol: float = 1e-7) -> tuple[np.ndarray, int]:
    """Minimise max_m rho_m (Themis, ch. 5.4.2), rho_m = (t_m + steps_m / throughput(m, X)) /
    (t_iso_m + steps_m / throughput(m, X^isolated)). For a fixed rho the constraints are linear
    (throughput(m, X) >= steps_m / (rho D_m - t_m)), so rho is found by bisection over feasibility LPs.
    Each feasible LP also uses every GPU that still speeds a job up, so the rho its X reaches is often
    well below the rho asked for: the upper end drops to it, which cuts the bisection short."""
    elapsed = p.elapsed_s if p.elapsed_s is not None else np.zeros(p.shape[0])
    isolated = p.isolated_s if p.isolated_s is not None else np.zeros(p.shape[0])
    iso_thr = np.maximum(effective_throughput(p.T, isolated_share(p)), 1e-300)
    denom = isolated + p.steps / iso_thr

    def reached(X: np.ndarray) -> float:
        return float(np.max((elapsed + p.steps / np.maximum(p.throughput(X), 1e-300)) / denom))

    def attempt(rho: float) -> np.ndarray | None:
        room = rho * denom - elapsed
        if np.any(room <= 0):
            return None
        lp = AllocationLP(p)
        lp.add(lp.per_job(-np.ones(p.shape[0])), -p.steps / room)
        try:  # feasible at rho, using every GPU that still speeds a job up
            return lp.X(lp.solve(-lp.objective_x(1.0 / best_throughput(p))))
        except PlannerError:
            return None

    hi = float(np.max((elapsed + p.steps / iso_thr) / denom)) * (1 + 1e-6)  # X^isolated is feasible
    lo, best, lps = float(np.max(elapsed / denom)), attempt(hi), 1
    if best is None:  # numerical edge: X^isolated itself
        return p.pad(isolated_share(p)), lps
    hi = min(hi, reached(best))
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        X = attempt(mid)
        lps += 1
        if X is None:
            lo = mid
        elif reached(X) < hi:
            hi, best = reached(X), X
        else:  # the solver's tolerance: feasible at mid, yet no better than the best so far
            hi = mid
    return best, lps


def _cost_weight(p: Problem) -> np.ndarray:
    """Weights on each job's steps/s per type giving its normalised throughput per dollar (ch. 6.4.2,
    Gavel's linear form). A pair's GPU is paid once and both members progress on it."""
    return 1.0 / best_throughput(p)[:, None] / np.maximum(p.prices[None, :] * p.scale[:, None], 1e-9)


def min_cost(p: Problem) -> tuple[np.ndarray, int]:
    """Maximise sum_m sum_j X[m, j] T[m, j] / (T_m^fastest price_j scale_m): progress per dollar."""
    lp = AllocationLP(p)
    return lp.X(lp.solve(-lp.objective_x(_cost_weight(p)))), 1


def min_cost_slo(p: Problem) -> tuple[np.ndarray, int]:
    """min_cost subject to throughput(m, X) >= steps_m / time to the SLO (ch. 6.4.3). An SLO that
    cannot be met is missed as little as possible (a slack u_m, penalised far above any saving)
    rather than dropping every SLO as Gavel does when the LP is infeasible."""
    need, penalty = _slo_terms(p)
    lp = AllocationLP(p, extras=p.shape[0])
    lp.add(lp.per_job(-np.ones(p.shape[0]), -np.eye(p.shape[0])), -need)  # T_m . X_m + u_m >= need_m
    lp.bounds[-p.shape[0]:] = [(0.0, None)] * p.shape[0]
    c = -lp.objective_x(_cost_weight(p))
    c[-p.shape[0]:] = penalty
    return lp.X(lp.solve(c)), 1


def _slo_terms(p: Problem) -> tuple[np.ndarray, np.ndarray]:
    """Each job's SLO throughput (steps left / time left, at most its fastest) and the price per
    unit of it missed (0 without an SLO)."""
    deadline = p.deadline_s if p.deadline_s is not None else np.full(p.shape[0], np.inf)
    has = np.isfinite(deadline)
    need = np.where(has, np.minimum(p.steps / np.maximum(deadline, 1e-9), p.T.max(axis=1)), 0.0)
    return need, SLO_PENALTY * (p.T * _cost_weight(p)).max() * has / np.maximum(need, 1e-300)


def max_throughput(p: Problem) -> tuple[np.ndarray, int]:
    """Maximise the total normalised effective throughput (ch. 6.4.1): the cost policies' baseline."""
    lp = AllocationLP(p)
    return lp.X(lp.solve(-lp.objective_x(1.0 / best_throughput(p)))), 1


def _fill(T_row: np.ndarray, scale: float, free: np.ndarray, spread: bool, counts: np.ndarray) -> np.ndarray:
    """The most one job can take of the ``free`` GPUs: its fastest types first (a fractional knapsack
    with unit weights, so this is its best throughput), or, ``spread`` (agnostic), a row over its
    runnable types in proportion to their GPU counts, as large as the free GPUs allow."""
    row = np.zeros_like(free)
    runs = np.flatnonzero(T_row > 0)
    if spread:
        share = counts[runs] / counts[runs].sum()
        alpha = min(1.0, float(np.min(free[runs] / (scale * share))))
        row[runs] = alpha * share
        return row
    for j in runs[np.argsort(-T_row[runs], kind="stable")]:
        row[j] = min(1.0 - row.sum(), free[j] / scale)
    return row


def shortest_job_first(p: Problem) -> tuple[np.ndarray, int]:
    """A greedy baseline (shortest remaining time first): jobs in increasing order of the time they
    would need alone (steps / the best throughput they can get on the whole fleet) each take what
    they can of the GPUs still free, fastest types first. The first job gets its best allocation, so
    the shortest job finishes as early as any allocation allows (the objective of ch. 5.4.2's SJF);
    no LP."""
    counts = p.counts.astype(float)
    alone = np.array([effective_throughput(p.T[m:m + 1], _fill(p.T[m], p.scale[m], counts, p.spread, counts)[None])[0]
                      for m in range(p.shape[0])])
    order = np.argsort(np.where(alone > 0, p.steps / np.maximum(alone, 1e-300), np.inf), kind="stable")
    X, free = np.zeros(p.shape), counts.copy()
    for m in order:
        X[m] = _fill(p.T[m], p.scale[m], free, p.spread, counts)
        free = np.maximum(free - X[m] * p.scale[m], 0.0)
    return p.pad(X), 0


SOLVERS: dict[str, Callable[[Problem], tuple[np.ndarray, int]]] = {
    "max_min_fairness": max_min_fairness, "max_min_fairness_water_filling": max_min_fairness_water_filling,
    "fifo": fifo, "makespan": makespan,
    "finish_time_fairness": finish_time_fairness, "min_cost": min_cost, "min_cost_slo": min_cost_slo,
    "max_throughput": max_throughput, "sjf": shortest_job_first,
    "hierarchical_fairness": hierarchical_fairness, "hierarchical_fifo": hierarchical_fifo}


def objective_value(policy: str, p: Problem, X: np.ndarray) -> float:
    """The policy's objective for X under p's T (higher is better for every policy: makespan and
    finish-time fairness are negated, cost policies count progress per dollar, SLOs missed are
    charged as in the LP; hierarchical ones count their first round)."""
    thr = p.throughput(X)
    if policy in ("max_min_fairness", "max_min_fairness_water_filling"):
        equal = np.maximum(effective_throughput(p.T, equal_share(p)), 1e-300)
        return float(np.min(p.scale / p.weights * thr / equal))
    if policy.startswith("hierarchical_"):
        return first_level(p, X, policy.removeprefix("hierarchical_"))
    if policy == "fifo":
        rank = p.shape[0] - np.arange(p.shape[0])
        return float(np.sum(rank * thr / best_throughput(p)))
    if policy == "makespan":
        return float(-np.max(p.steps / np.maximum(thr, 1e-300)))
    if policy == "sjf":  # minus the shortest job's time to finish
        return float(-np.min(p.steps / np.maximum(thr, 1e-300)))
    if policy == "finish_time_fairness":
        elapsed = p.elapsed_s if p.elapsed_s is not None else np.zeros(p.shape[0])
        isolated = p.isolated_s if p.isolated_s is not None else np.zeros(p.shape[0])
        iso = np.maximum(effective_throughput(p.T, isolated_share(p)), 1e-300)
        return float(-np.max((elapsed + p.steps / np.maximum(thr, 1e-300)) / (isolated + p.steps / iso)))
    if policy == "min_cost":
        return float(np.sum(_cost_weight(p) * p.per_type(X)))
    if policy == "min_cost_slo":  # the LP's objective: progress per dollar less the missed SLO throughput
        need, penalty = _slo_terms(p)
        return float(np.sum(_cost_weight(p) * p.per_type(X)) - penalty @ np.maximum(need - thr, 0.0))
    return float(np.sum(thr / best_throughput(p)))


def allocate(policy: str, p: Problem, heterogeneity: str = "aware") -> Allocation:
    if policy not in SOLVERS:
        raise PlannerError(f"policy={policy!r} is unknown: choose one of {', '.join(POLICIES)}")
    if heterogeneity not in ("aware", "agnostic"):
        raise PlannerError(f"heterogeneity={heterogeneity!r} is unknown: choose aware (Gavel) or agnostic "
                           f"(every type alike, the baseline)")
    import scipy.optimize  # noqa: F401  (imported before the clock starts: solve_s times the LPs)

    start = time.perf_counter()
    if p.shape[0] == 0:
        X, lps = np.zeros((p.num_pairs, p.shape[1])), 0
    else:
        seen = p if heterogeneity == "aware" else p.agnostic()
        X, lps = SOLVERS[policy](seen)
        X = X if len(X) == p.shape[0] + p.num_pairs else p.pad(X)  # agnostic: no pairs
    return Allocation(X, policy, heterogeneity, objective_value(policy, p, X) if p.shape[0] else 0.0,
                      time.perf_counter() - start, lps)
