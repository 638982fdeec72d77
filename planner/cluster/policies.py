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
from typing import Callable, Sequence

import numpy as np

from planner.errors import PlannerError

POLICIES = ("max_min_fairness", "max_min_fairness_water_filling", "fifo", "makespan", "finish_time_fairness",
            "min_cost", "min_cost_slo", "max_throughput", "sjf")
SLO_PENALTY = 1e3  # per unit of missed SLO throughput (relative): meeting SLOs beats any saving


@dataclass(frozen=True)
class Problem:
    """What a policy needs. ``steps``: remaining steps; ``elapsed_s`` / ``isolated_s``: time since
    arrival and the time the same progress would have taken on 1/n of the cluster (finish-time
    fairness); ``deadline_s``: seconds left to each job's SLO (inf: none)."""

    T: np.ndarray  # (jobs, types) steps/s
    counts: np.ndarray  # GPUs per type
    scale: np.ndarray  # GPUs per job
    weights: np.ndarray
    steps: np.ndarray
    prices: np.ndarray  # dollars per GPU-hour
    elapsed_s: np.ndarray | None = None
    isolated_s: np.ndarray | None = None
    deadline_s: np.ndarray | None = None
    spread: bool = False  # agnostic: time on the runnable types in proportion to their GPUs
    # space sharing (ch. 5.3.1): job pairs (P, 2) that may share a GPU, and each member's steps/s
    # when they do, per type (P, types, 2; 0: not on that type). X then has a row per job, then one
    # per pair, and a job's throughput sums over the rows it is in.
    pairs: np.ndarray | None = None
    pair_T: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.T.shape

    @property
    def num_pairs(self) -> int:
        return 0 if self.pairs is None else len(self.pairs)

    def members(self) -> list[tuple[int, ...]]:
        """The jobs in each row of X: each job alone, then the pairs."""
        pairs = [tuple(int(m) for m in pair) for pair in self.pairs] if self.num_pairs else []
        return [(m,) for m in range(self.shape[0])] + pairs

    def row_scale(self) -> np.ndarray:
        """GPUs each row of X occupies (a pair shares its members' GPUs: they ask for as many)."""
        return np.concatenate([self.scale, self.scale[self.pairs[:, 0]] if self.num_pairs else []]).astype(float)

    def runnable(self) -> np.ndarray:
        """(rows, types): where each row of X may have time (a pair only where both members run)."""
        alone = self.T > 0
        if not self.num_pairs:
            return alone
        return np.vstack([alone, (self.pair_T > 0).all(axis=2)])

    def per_type(self, X: np.ndarray) -> np.ndarray:
        """(jobs, types): each job's steps/s from its time on each type, alone or paired."""
        n = self.shape[0]
        out = self.T * X[:n]
        if self.num_pairs:
            paired = X[n:] * self.runnable()[n:]
            np.add.at(out, self.pairs[:, 0], self.pair_T[:, :, 0] * paired)
            np.add.at(out, self.pairs[:, 1], self.pair_T[:, :, 1] * paired)
        return out

    def throughput(self, X: np.ndarray) -> np.ndarray:
        """throughput(m, X) (ch. 5.3.1, with space sharing: summed over the rows m is in)."""
        return self.per_type(X).sum(axis=1)

    def pad(self, X: np.ndarray) -> np.ndarray:
        """X over the jobs alone, with zero rows for the pairs."""
        return np.vstack([X, np.zeros((self.num_pairs, self.shape[1]))])

    def agnostic(self) -> "Problem":
        """No space sharing: an agnostic scheduler does not know which pairs co-locate well."""
        return Problem(agnostic_T(self.T, self.counts), self.counts, self.scale, self.weights, self.steps,
                       self.prices, self.elapsed_s, self.isolated_s, self.deadline_s, spread=True)


@dataclass
class Allocation:
    X: np.ndarray
    policy: str
    heterogeneity: str
    objective: float  # the policy's own objective, evaluated with the true T (see objective_value)
    solve_s: float
    lps: int
    notes: list[str] = field(default_factory=list)


def agnostic_T(T: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each job's throughput averaged over the GPUs of the types it runs on, on every such type."""
    runs = T > 0
    pooled = (T * counts).sum(axis=1) / np.maximum((runs * counts).sum(axis=1), 1)
    return runs * pooled[:, None]


def equal_share(p: Problem) -> np.ndarray:
    """X^equal (ch. 5.4.1): time on each type in proportion to its GPUs, a full row."""
    return np.broadcast_to(p.counts / p.counts.sum(), p.shape) * (p.T > 0)


def isolated_share(p: Problem) -> np.ndarray:
    """X^isolated (finish-time fairness): 1/n of every type's GPUs, as time on ``scale`` GPUs."""
    n = p.shape[0]
    row = np.minimum(1.0, p.counts.sum() / (n * p.scale))
    return (row[:, None] * p.counts / p.counts.sum()) * (p.T > 0)


def effective_throughput(T: np.ndarray, X: np.ndarray) -> np.ndarray:
    return (T * X).sum(axis=1)


class _LP:
    """min c.v over v = (X flattened, extras) with X's validity constraints built in. X has a row per
    job and per pair (space sharing); C maps it to each job's steps/s per type."""

    def __init__(self, p: Problem, extras: int = 0):
        from scipy import sparse

        self.p, (self.n, self.k), self.extras = p, p.shape, extras
        n, k = self.n, self.k
        R = n + p.num_pairs
        self.R, self.size = R, R * k + extras
        runnable = p.runnable()
        member_rows = np.arange(n)
        member_jobs = np.arange(n)
        if p.num_pairs:
            member_rows = np.concatenate([member_rows, n + np.arange(p.num_pairs), n + np.arange(p.num_pairs)])
            member_jobs = np.concatenate([member_jobs, p.pairs[:, 0], p.pairs[:, 1]])
        member = sparse.csr_matrix((np.ones(len(member_rows)), (member_jobs, member_rows)), shape=(n, R))
        rows = sparse.kron(member, np.ones((1, k)))  # sum over m's rows and types <= 1
        caps = sparse.kron(p.row_scale().reshape(1, -1), sparse.eye(k))  # sum_r s_r X[r, j] <= W_j
        self.blocks = [sparse.hstack([rows, sparse.csr_matrix((n, extras))]),
                       sparse.hstack([caps, sparse.csr_matrix((k, extras))])]
        self.rhs = [np.ones(n), p.counts.astype(float)]
        self.bounds = [(0.0, float(u)) for u in runnable.ravel()] + [(None, None)] * extras
        # C[(m, j), (r, j)]: job m's steps/s on type j from row r
        rate = np.concatenate([p.T.ravel()] + ([(p.pair_T[:, :, 0] * runnable[n:]).ravel(),
                                                (p.pair_T[:, :, 1] * runnable[n:]).ravel()] if p.num_pairs else []))
        col = np.arange(R * k) if not p.num_pairs else np.concatenate([np.arange(R * k), np.arange(n * k, R * k)])
        job = np.repeat(member_jobs, k) if p.num_pairs else np.repeat(np.arange(n), k)
        self.C = sparse.csr_matrix((rate, (job * k + col % k, col)), shape=(n * k, R * k))
        self.eq = self._spread_rows() if p.spread else None

    def _spread_rows(self):
        """X[m, j] W_j' - X[m, j'] W_j = 0 for consecutive runnable types j, j' of each job."""
        from scipy import sparse

        data, rows, cols = [], [], []
        for m in range(self.n):
            runs = np.flatnonzero(self.p.T[m] > 0)
            for j, jj in zip(runs[:-1], runs[1:]):
                r = len(rows) // 2
                rows += [r, r]
                cols += [m * self.k + j, m * self.k + jj]
                data += [float(self.p.counts[jj]), -float(self.p.counts[j])]
        if not rows:
            return None
        return sparse.csr_matrix((data, (rows, cols)), shape=(len(rows) // 2, self.size))

    def per_job(self, weight: np.ndarray, extra: np.ndarray | None = None):
        """Rows sum_j weight[m, j] x (m's steps/s on type j) (+ extra[m] . extras), one per job;
        ``weight`` (jobs,) weighs every type alike."""
        from scipy import sparse

        n, k = self.n, self.k
        w = np.broadcast_to(np.asarray(weight, dtype=float).reshape(n, -1), (n, k))
        pick = sparse.csr_matrix((w.ravel(), (np.repeat(np.arange(n), k), np.arange(n * k))), shape=(n, n * k))
        right = sparse.csr_matrix(extra if extra is not None else np.zeros((n, self.extras)))
        return sparse.hstack([pick @ self.C, right])

    def add(self, rows, rhs: np.ndarray) -> None:
        self.blocks.append(rows)
        self.rhs.append(np.asarray(rhs, dtype=float))

    def solve(self, c: np.ndarray) -> np.ndarray:
        from scipy import sparse
        from scipy.optimize import linprog

        res = linprog(c, A_ub=sparse.vstack(self.blocks).tocsr(), b_ub=np.concatenate(self.rhs),
                      A_eq=self.eq, b_eq=None if self.eq is None else np.zeros(self.eq.shape[0]),
                      bounds=self.bounds, method="highs")
        if res.status != 0:
            raise PlannerError(f"the allocation LP did not solve: {res.message}")
        return res.x

    def X(self, v: np.ndarray) -> np.ndarray:
        return np.clip(v[: self.R * self.k].reshape(self.R, self.k), 0.0, 1.0) + 0.0  # no -0.0 in reports

    def objective_x(self, weight: np.ndarray) -> np.ndarray:
        """sum_m sum_j weight[m, j] x (m's steps/s on type j) as a cost vector over v."""
        w = np.broadcast_to(np.asarray(weight, dtype=float).reshape(self.n, -1), (self.n, self.k))
        return np.concatenate([self.C.T @ w.ravel(), np.zeros(self.extras)])


KEEP_REL_TOL = 1e-7  # how far the second LP may let the first one's optimum slip, relative to it


def _use_leftovers(lp: _LP, v: np.ndarray, keep: np.ndarray, keep_at: float, norm: np.ndarray) -> np.ndarray:
    """Second LP: hold the first one's objective (``keep`` . v <= ``keep_at``, a minimisation) and raise
    the total normalised throughput, so no GPU stays idle that could still speed a job up. The slack is
    relative to the optimum (the row is divided by it): an absolute one would dwarf small objectives."""
    from scipy import sparse

    scale = abs(keep_at)
    if scale == 0.0:  # an optimum of 0: nothing to be relative to, hold it at 0 (up to the tolerance)
        scale = 1.0
    lp.add(sparse.csr_matrix(keep.reshape(1, -1) / scale), [keep_at / scale + KEEP_REL_TOL])
    return lp.solve(-lp.objective_x(1.0 / norm))


def _best(p: Problem) -> np.ndarray:
    return np.maximum(p.T.max(axis=1), 1e-300)


def max_min_fairness(p: Problem) -> tuple[np.ndarray, int]:
    """Maximise min_m scale_m / w_m * throughput(m, X) / throughput(m, X^equal) (ch. 5.4.1, LAS)."""
    lp = _LP(p, extras=1)
    a = _fair_shares(p)
    lp.add(lp.per_job(-a, np.ones((p.shape[0], 1))), np.zeros(p.shape[0]))  # t - a_m . X_m <= 0
    c = np.zeros(lp.size)
    c[-1] = -1.0
    v = lp.solve(c)
    return lp.X(_use_leftovers(lp, v, c, float(c @ v), _best(p))), 2


WATER_RISE_REL = 1e-5  # a job whose share can rise by less than this (relative) is bottlenecked


def _fair_shares(p: Problem) -> np.ndarray:
    """a with a_m throughput(m, X) = scale_m / w_m throughput(m, X) / throughput(m, X^equal): LAS's share."""
    equal = effective_throughput(p.T, equal_share(p))
    return p.scale / (p.weights * np.maximum(equal, 1e-300))


HOLD_SLACKS = (KEEP_REL_TOL, 1e-6, 1e-5)  # looser only when the solver finds the tighter hold infeasible


def _holding(p: Problem, a: np.ndarray, floor: np.ndarray, extra: np.ndarray, slack: float) -> _LP:
    """Valid X with share_m + extra[m] . extras >= floor_m (within ``slack``, relative) for every job."""
    lp = _LP(p, extras=extra.shape[1])
    lp.add(lp.per_job(-a, extra), -floor * (1 - slack))
    return lp


def _solve_holding(p: Problem, a: np.ndarray, floor: np.ndarray, extra: np.ndarray,
                   objective: Callable[[_LP], np.ndarray], bounds: Sequence | None = None) -> tuple[_LP, np.ndarray]:
    for slack in HOLD_SLACKS:
        lp = _holding(p, a, floor, extra, slack)
        if bounds is not None:
            lp.bounds[-len(bounds):] = bounds
        try:
            return lp, lp.solve(objective(lp))
        except PlannerError:
            if slack == HOLD_SLACKS[-1]:
                raise
    raise AssertionError("unreachable")


def _extras_objective(lp: _LP) -> np.ndarray:
    c = np.zeros(lp.size)
    c[lp.R * lp.k:] = -1.0
    return c


def max_min_fairness_water_filling(p: Problem) -> tuple[np.ndarray, int]:
    """Water filling (ch. 5.4.3): raise the lowest normalised share of the jobs not yet frozen as far
    as it goes (one LP), freeze the jobs that are bottlenecked there, i.e. whose share cannot rise
    while every other job keeps its level, and repeat until every job is frozen. The result is
    max-min fair: no share can rise without lowering one that is no larger, so no GPU that could
    speed a job up stays idle.

    The bottlenecked jobs are found with LPs in place of the dissertation's MILP: maximise the
    candidates' total rise above the level, each rise capped so that it spreads over every candidate
    that can rise; drop those that rose and repeat until none does (usually one or two LPs). If none
    rises, none can: one rising alone would raise the total."""
    n = p.shape[0]
    a = _fair_shares(p)
    floor = np.zeros(n)
    rising = np.ones(n, dtype=bool)
    lps = 0
    while rising.any():
        # share_m >= t for the rising jobs (t the one extra variable, maximised), >= floor_m for the rest
        lp, v = _solve_holding(p, a, np.where(rising, 0.0, floor), rising.astype(float).reshape(-1, 1),
                               _extras_objective)
        lps += 1
        level = max(float((a * p.throughput(lp.X(v)))[rising].min()), 0.0)  # what X reaches: a floor it meets
        floor = np.where(rising, level, floor)
        candidates = rising.copy()
        cap = 1e-2 * max(level, 1e-3)
        while candidates.any():
            lp, v = _solve_holding(p, a, floor, np.eye(n), _extras_objective,
                                   [(0.0, cap if c else 0.0) for c in candidates])  # share_m - r_m >= floor_m
            lps += 1
            rose = v[-n:] > WATER_RISE_REL * max(level, 1e-12)
            if not rose.any():
                break
            candidates &= ~rose
        if not candidates.any():  # not in exact arithmetic (the level's LP found it tight): freeze the first
            candidates = rising & (np.arange(n) == np.flatnonzero(rising)[0])
        rising &= ~candidates
    # every level held, the spare GPUs used
    lp, v = _solve_holding(p, a, floor, np.zeros((n, 0)), lambda lp: -lp.objective_x(1.0 / _best(p)))
    return lp.X(v), lps + 1


def fifo(p: Problem) -> tuple[np.ndarray, int]:
    """Maximise sum_m (M - m) throughput(m, X) / throughput(m, X^fastest), jobs in arrival order."""
    lp = _LP(p)
    rank = p.shape[0] - np.arange(p.shape[0])
    return lp.X(lp.solve(-lp.objective_x(rank / _best(p)))), 1


def makespan(p: Problem) -> tuple[np.ndarray, int]:
    """Minimise max_m steps_m / throughput(m, X): maximise z with throughput(m, X) >= steps_m z. Rows
    are scaled so z is of order 1 (z = D / makespan, D the longest time any job needs alone on its
    fastest type) rather than 1 / makespan, which is tiny in seconds."""
    lp = _LP(p, extras=1)
    best = _best(p)
    alone = p.steps / best
    lp.add(lp.per_job(-1.0 / best, (alone / max(float(alone.max()), 1e-300)).reshape(-1, 1)),
           np.zeros(p.shape[0]))
    c = np.zeros(lp.size)
    c[-1] = -1.0
    v = lp.solve(c)
    return lp.X(_use_leftovers(lp, v, c, float(c @ v), _best(p))), 2


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
        lp = _LP(p)
        lp.add(lp.per_job(-np.ones(p.shape[0])), -p.steps / room)
        try:  # feasible at rho, using every GPU that still speeds a job up
            return lp.X(lp.solve(-lp.objective_x(1.0 / _best(p))))
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
    return 1.0 / _best(p)[:, None] / np.maximum(p.prices[None, :] * p.scale[:, None], 1e-9)


def min_cost(p: Problem) -> tuple[np.ndarray, int]:
    """Maximise sum_m sum_j X[m, j] T[m, j] / (T_m^fastest price_j scale_m): progress per dollar."""
    lp = _LP(p)
    return lp.X(lp.solve(-lp.objective_x(_cost_weight(p)))), 1


def min_cost_slo(p: Problem) -> tuple[np.ndarray, int]:
    """min_cost subject to throughput(m, X) >= steps_m / time to the SLO (ch. 6.4.3). An SLO that
    cannot be met is missed as little as possible (a slack u_m, penalised far above any saving)
    rather than dropping every SLO as Gavel does when the LP is infeasible."""
    need, penalty = _slo_terms(p)
    lp = _LP(p, extras=p.shape[0])
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
    lp = _LP(p)
    return lp.X(lp.solve(-lp.objective_x(1.0 / _best(p)))), 1


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
    "max_throughput": max_throughput, "sjf": shortest_job_first}


def objective_value(policy: str, p: Problem, X: np.ndarray) -> float:
    """The policy's objective for X under p's T (higher is better for every policy: makespan and
    finish-time fairness are negated, cost policies count progress per dollar, SLOs missed are
    charged as in the LP)."""
    thr = p.throughput(X)
    if policy in ("max_min_fairness", "max_min_fairness_water_filling"):
        equal = np.maximum(effective_throughput(p.T, equal_share(p)), 1e-300)
        return float(np.min(p.scale / p.weights * thr / equal))
    if policy == "fifo":
        rank = p.shape[0] - np.arange(p.shape[0])
        return float(np.sum(rank * thr / _best(p)))
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
    return float(np.sum(thr / _best(p)))


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


def validity_errors(X: np.ndarray, p: Problem, tol: float = 1e-6) -> Sequence[str]:
    """What makes X invalid (eqs. 5.1-5.3 and the cannot-run mask; with space sharing a job's time
    sums over every row it is in), empty when it is valid."""
    errors = []
    if X.shape != (p.shape[0] + p.num_pairs, p.shape[1]):
        return [f"shape {X.shape}, expected {(p.shape[0] + p.num_pairs, p.shape[1])}"]
    if np.any(X < -tol) or np.any(X > 1 + tol):
        errors.append("entries outside [0, 1]")
    time_per_job = np.zeros(p.shape[0])
    for r, members in enumerate(p.members()):
        time_per_job[list(members)] += X[r].sum()
    if np.any(time_per_job > 1 + tol):
        errors.append(f"jobs over all their time: {np.flatnonzero(time_per_job > 1 + tol).tolist()}")
    used = (X * p.row_scale()[:, None]).sum(axis=0)
    if np.any(used > p.counts + tol * max(1, p.counts.max())):
        errors.append(f"types over capacity: used {used.round(4).tolist()} of {p.counts.tolist()}")
    if np.any(X[~p.runnable()] > tol):
        errors.append("time on a type the job (or a member of the pair) cannot run on")
    return errors
