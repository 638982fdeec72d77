"""Max-min fairness by water filling (dissertation ch. 5.4.3), ``policy=max_min_fairness_water_filling``."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from planner.cluster.lp import KEEP_REL_TOL, AllocationLP
from planner.cluster.problem import Problem, best_throughput, fair_share_weights
from planner.errors import PlannerError

WATER_RISE_REL = 1e-5  # a job whose share can rise by less than this (relative) is bottlenecked
DUAL_TOL = 1e-6  # a hold row's weighted dual above this (they sum to 1) marks its job bottlenecked
HOLD_SLACKS = (KEEP_REL_TOL, 1e-6, 1e-5)  # looser only when the solver finds the tighter hold infeasible


def _holding(p: Problem, a: np.ndarray, floor: np.ndarray, extra: np.ndarray, slack: float) -> AllocationLP:
    """Valid X with share_m + extra[m] . extras >= floor_m (within ``slack``, relative) for every job."""
    lp = AllocationLP(p, extras=extra.shape[1])
    lp.add(lp.per_job(-a, extra), -floor * (1 - slack))
    return lp


def _solve_holding(p: Problem, a: np.ndarray, floor: np.ndarray, extra: np.ndarray,
                   objective: Callable[[AllocationLP], np.ndarray], bounds: Sequence | None = None) -> tuple[AllocationLP, np.ndarray]:
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


def _extras_objective(lp: AllocationLP) -> np.ndarray:
    c = np.zeros(lp.size)
    c[lp.R * lp.k:] = -1.0
    return c


def bottlenecked_by_duals(lp: AllocationLP, weight: np.ndarray) -> np.ndarray:
    """The jobs that a level LP (max t with share_m >= floor_m + weight_m t for the rising jobs, the
    hold rows last) shows bottlenecked: those whose hold row has a positive dual y_m. By LP duality
    (sum_m y_m weight_m = 1, t's coefficient), sum_m y_m share_m(X) stays within the optimum plus the
    duals' other terms for every valid X, so no X raises such a job above its new level while every
    other job keeps its own. No LP beyond the level's; jobs with a zero dual may be bottlenecked
    too: they are found at the next level, which then does not rise."""
    y = lp.duals[-lp.n:]
    return (weight > 0) & (y * weight > DUAL_TOL)


def frozen_at_level(lp: AllocationLP, p: Problem, a: np.ndarray, floor: np.ndarray, weight: np.ndarray,
                    cap: float, rise: float) -> tuple[np.ndarray, int]:
    """(the jobs bottlenecked at a level LP's new floors, LPs solved for it): read from its duals,
    or where none shows one, found with LPs (``bottlenecked``, with its ``cap`` and ``rise``)."""
    stuck = bottlenecked_by_duals(lp, weight)
    if stuck.any():
        return stuck, 0
    return bottlenecked(p, a, floor, weight > 0, cap, rise)


def bottlenecked(p: Problem, a: np.ndarray, floor: np.ndarray, among: np.ndarray, cap: float,
                 rise: float) -> tuple[np.ndarray, int]:
    """(the jobs of ``among`` whose share a_m . throughput cannot rise while every job holds its
    ``floor``, LPs solved). In place of the dissertation's MILP: maximise the candidates' total rise,
    each capped at ``cap`` so that it spreads over every candidate that can rise; drop those that rose
    more than ``rise`` and repeat until none does (usually one or two LPs). If none rises, none can:
    one rising alone would raise the total. Never empty: where the LPs disagree in the last digits
    (the level's LP found a job tight that can still rise) the first candidate is taken."""
    n = p.shape[0]
    candidates, lps = among.copy(), 0
    while candidates.any():
        lp, v = _solve_holding(p, a, floor, np.eye(n), _extras_objective,
                               [(0.0, cap if c else 0.0) for c in candidates])  # share_m - r_m >= floor_m
        lps += 1
        rose = v[-n:] > rise
        if not rose.any():
            break
        candidates &= ~rose
    if not candidates.any():
        candidates = among & (np.arange(n) == np.flatnonzero(among)[0])
    return candidates, lps


def max_min_fairness_water_filling(p: Problem) -> tuple[np.ndarray, int]:
    """Water filling (ch. 5.4.3): raise the lowest normalised share of the jobs not yet frozen as far
    as it goes (one LP), freeze the jobs that are bottlenecked there, i.e. whose share cannot rise
    while every other job keeps its level, and repeat until every job is frozen. The result is
    max-min fair: no share can rise without lowering one that is no larger, so no GPU that could
    speed a job up stays idle. The bottlenecked jobs are read from the level LP's duals
    (``bottlenecked_by_duals``), or found with LPs (``bottlenecked``) where no dual shows one."""
    n = p.shape[0]
    a = fair_share_weights(p)
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
        stuck, used = frozen_at_level(lp, p, a, floor, rising.astype(float), 1e-2 * max(level, 1e-3),
                                      WATER_RISE_REL * max(level, 1e-12))
        lps += used
        rising &= ~stuck
    # every level held, the spare GPUs used
    lp, v = _solve_holding(p, a, floor, np.zeros((n, 0)), lambda lp: -lp.objective_x(1.0 / best_throughput(p)))
    return lp.X(v), lps + 1
