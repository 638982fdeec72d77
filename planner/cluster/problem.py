"""What Gavel's policies allocate (dissertation ch. 5.3): the problem, the allocation X, and X's validity.

X[m, j] is the fraction of time job m spends on type j until the next re-solve; its *effective
throughput* is sum_j T[m, j] X[m, j]. A valid X (eqs. 5.1-5.3): 0 <= X <= 1, each job's time sums to
at most 1, and sum_m X[m, j] scale_factor[m] <= GPUs of type j; X[m, j] = 0 where the job cannot run
(T = 0). With space sharing X has a row per job combination (each job alone, then pairs).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np


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
    # hierarchical policies (ch. 5.4.3): each job's entity (an index into entity_weights) and the
    # entities' weights; None: every job an entity of its own, weighing its ``weights``
    entity: np.ndarray | None = None
    entity_weights: np.ndarray | None = None

    @cached_property
    def lp_parts(self) -> dict:
        """The allocation LP's matrices per number of extra variables (``planner.cluster.lp``), built
        at the first LP over this problem and shared by the next ones."""
        return {}

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
                       self.prices, self.elapsed_s, self.isolated_s, self.deadline_s, spread=True,
                       entity=self.entity, entity_weights=self.entity_weights)


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


def best_throughput(p: Problem) -> np.ndarray:
    """Each job's fastest throughput (a floor keeps divisions finite)."""
    return np.maximum(p.T.max(axis=1), 1e-300)


def fair_share_weights(p: Problem) -> np.ndarray:
    """a with a_m throughput(m, X) = scale_m / w_m throughput(m, X) / throughput(m, X^equal): LAS's share."""
    equal = effective_throughput(p.T, equal_share(p))
    return p.scale / (p.weights * np.maximum(equal, 1e-300))


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
