"""Independent LP rows for checking the cluster planner's allocations with scipy's linprog."""
from __future__ import annotations

import numpy as np

from planner.cluster.policies import Problem


def valid_rows(p: Problem, extras: int):
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
