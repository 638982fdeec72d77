"""The allocation LP (HiGHS through ``scipy.optimize.linprog``): variables X flattened (a row per job
combination, a column per type) plus a policy's extra variables, with X's validity built in."""
from __future__ import annotations

import numpy as np

from planner.cluster.problem import Problem
from planner.errors import PlannerError

KEEP_REL_TOL = 1e-7  # how far the second LP may let the first one's optimum slip, relative to it


class AllocationLP:
    """min c.v over v = (X flattened, extras) with X's validity constraints built in. X has a row per
    job and per pair (space sharing); C maps it to each job's steps/s per type."""

    def __init__(self, p: Problem, extras: int = 0):
        self.p, (self.n, self.k), self.extras = p, p.shape, extras
        self.R, self.size = self.n + p.num_pairs, (self.n + p.num_pairs) * self.k + extras
        # the validity rows, C and the spread rows depend on the problem alone: a policy solving many
        # LPs over one problem (bisection, water filling) builds them once (scipy.sparse is slow to build)
        built = p.lp_parts.get(extras)
        if built is None:
            built = p.lp_parts[extras] = self._build()
        blocks, rhs, bounds, self.C, self.eq = built
        self.blocks, self.rhs, self.bounds = list(blocks), list(rhs), list(bounds)

    def _build(self) -> tuple:
        from scipy import sparse

        p, n, k, R, extras = self.p, self.n, self.k, self.R, self.extras
        runnable = p.runnable()
        member_rows = np.arange(n)
        member_jobs = np.arange(n)
        if p.num_pairs:
            member_rows = np.concatenate([member_rows, n + np.arange(p.num_pairs), n + np.arange(p.num_pairs)])
            member_jobs = np.concatenate([member_jobs, p.pairs[:, 0], p.pairs[:, 1]])
        member = sparse.csr_matrix((np.ones(len(member_rows)), (member_jobs, member_rows)), shape=(n, R))
        rows = sparse.kron(member, np.ones((1, k)))  # sum over m's rows and types <= 1
        caps = sparse.kron(p.row_scale().reshape(1, -1), sparse.eye(k))  # sum_r s_r X[r, j] <= W_j
        blocks = (sparse.hstack([rows, sparse.csr_matrix((n, extras))]),
                  sparse.hstack([caps, sparse.csr_matrix((k, extras))]))
        rhs = (np.ones(n), p.counts.astype(float))
        bounds = tuple((0.0, float(u)) for u in runnable.ravel()) + ((None, None),) * extras
        # C[(m, j), (r, j)]: job m's steps/s on type j from row r
        rate = np.concatenate([p.T.ravel()] + ([(p.pair_T[:, :, 0] * runnable[n:]).ravel(),
                                                (p.pair_T[:, :, 1] * runnable[n:]).ravel()] if p.num_pairs else []))
        col = np.arange(R * k) if not p.num_pairs else np.concatenate([np.arange(R * k), np.arange(n * k, R * k)])
        job = np.repeat(member_jobs, k) if p.num_pairs else np.repeat(np.arange(n), k)
        C = sparse.csr_matrix((rate, (job * k + col % k, col)), shape=(n * k, R * k))
        return blocks, rhs, bounds, C, self._spread_rows() if p.spread else None

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
        self.duals = -res.ineqlin.marginals   # >= 0: the objective's rise per unit that a row's bound tightens
        return res.x

    def X(self, v: np.ndarray) -> np.ndarray:
        return np.clip(v[: self.R * self.k].reshape(self.R, self.k), 0.0, 1.0) + 0.0  # no -0.0 in reports

    def objective_x(self, weight: np.ndarray) -> np.ndarray:
        """sum_m sum_j weight[m, j] x (m's steps/s on type j) as a cost vector over v."""
        w = np.broadcast_to(np.asarray(weight, dtype=float).reshape(self.n, -1), (self.n, self.k))
        return np.concatenate([self.C.T @ w.ravel(), np.zeros(self.extras)])
