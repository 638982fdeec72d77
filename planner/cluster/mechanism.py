"""Gavel's round-based scheduling mechanism (dissertation ch. 5.3.2, 5.5, Algorithm 2).

An allocation X says what fraction of time each job should get on each type; the mechanism turns
it into whole rounds (6 minutes in the paper): every round, each (job, type) pair has priority
X[m, j] / f[m, j], where f is the fraction of rounds since the allocation was computed in which
the job ran on that type (never run: infinite). Pairs are taken in decreasing priority (ties: the
larger X first) while the type has ``scale_factor`` GPUs free and the job is not placed yet, so a
job that fell behind its share rises and one ahead sinks; over many rounds f approaches X.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


class RoundMechanism:
    def __init__(self, counts: Sequence[int]):
        self.counts = np.asarray(counts, dtype=int)
        self.X = np.zeros((0, len(self.counts)))
        self.received = np.zeros_like(self.X)  # rounds run per (job, type) since the last reset
        self.rounds = 0

    def reset(self, X: np.ndarray) -> None:
        """A new allocation (after a re-solve): the received fractions start over (ch. 5.3)."""
        self.X = np.asarray(X, dtype=float)
        self.received = np.zeros_like(self.X)
        self.rounds = 0

    def priorities(self) -> np.ndarray:
        fraction = self.received / max(self.rounds, 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            pri = np.where(fraction > 0, self.X / fraction, np.inf)
        return np.where(self.X > 1e-9, pri, 0.0)

    def schedule(self, scale: Sequence[int], members: Sequence[Sequence[int]] | None = None) -> list[tuple[int, int]]:
        """(row, type) pairs to run this round (Algorithm 2: greedy by priority). A row is a job, or
        with space sharing a pair of jobs (``members``: the jobs in each row; ``scale``: each row's
        GPUs); a job runs in at most one row per round."""
        members = members if members is not None else [(r,) for r in range(self.X.shape[0])]
        pri = self.priorities()
        rows, types = np.nonzero(pri > 0)
        order = np.lexsort((-self.X[rows, types], -pri[rows, types]))  # last key is the primary one
        free = self.counts.copy()
        placed: set[int] = set()
        chosen = []
        for i in order:
            r, j = int(rows[i]), int(types[i])
            if placed.intersection(members[r]) or scale[r] > free[j]:
                continue
            chosen.append((r, j))
            placed.update(members[r])
            free[j] -= scale[r]
            if not free.any():
                break
        return chosen

    def record(self, chosen: Sequence[tuple[int, int]]) -> None:
        for m, j in chosen:
            self.received[m, j] += 1
        self.rounds += 1

    def realised(self) -> np.ndarray:
        """The fraction of rounds each job spent on each type since the last reset."""
        return self.received / max(self.rounds, 1)
