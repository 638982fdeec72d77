"""Hierarchical policies (dissertation ch. 5.4.3): weighted fairness across entities (teams), and
within each entity fairness or FIFO, by water filling. ``policy=hierarchical within=fairness|fifo``.

Each entity s has a weight w_s that its jobs share: in proportion to their own ``weight`` (fairness)
or all to the earliest job (FIFO). Every round raises each job's normalised share (scale_m x
throughput(m, X) / throughput(m, X^equal), LAS's) above its floor at the rate of its weight
w_m^job, as far as any valid X allows (one LP: max t with share_m >= floor_m + w_m^job t); the
jobs that cannot rise further while every other job holds its floor are bottlenecked and frozen at
what they reached, and their weight passes to their entity's other jobs (FIFO: the next one in
order). Rounds repeat until every job is frozen; a last LP holds every floor and uses what is left.
So entities' shares grow in proportion to their weights until one saturates, and no GPU a job could
use stays idle.
"""
from __future__ import annotations

import numpy as np

from planner.cluster.problem import Problem, best_throughput, effective_throughput, equal_share
from planner.cluster.water_filling import WATER_RISE_REL, _extras_objective, _solve_holding, frozen_at_level

WITHIN = ("fairness", "fifo")


def entities_of(p: Problem) -> tuple[np.ndarray, np.ndarray]:
    """(each job's entity, the entities' weights); without entities every job is its own, weighing ``weights``."""
    if p.entity is None:
        return np.arange(p.shape[0]), np.asarray(p.weights, dtype=float)
    return np.asarray(p.entity, dtype=int), np.asarray(p.entity_weights, dtype=float)


def job_weights(p: Problem, frozen: np.ndarray, within: str) -> np.ndarray:
    """w_m^job: each entity's weight over its jobs not yet frozen, in proportion to their own weights
    (fairness) or all to the first in order (FIFO, jobs listed in arrival order); 0 for the rest."""
    entity, weight = entities_of(p)
    out = np.zeros(p.shape[0])
    for e in np.unique(entity[~frozen]):
        members = np.flatnonzero((entity == e) & ~frozen)
        if within == "fifo":
            out[members[0]] = weight[e]
        else:
            own = np.asarray(p.weights, dtype=float)[members]
            out[members] = weight[e] * own / own.sum()
    return out


def normalised_share(p: Problem) -> np.ndarray:
    """a with a_m throughput(m, X) = scale_m throughput(m, X) / throughput(m, X^equal)."""
    return p.scale / np.maximum(effective_throughput(p.T, equal_share(p)), 1e-300)


def hierarchical(p: Problem, within: str) -> tuple[np.ndarray, int]:
    """Water filling over weighted entities (ch. 5.4.3); (X, LPs solved)."""
    n = p.shape[0]
    a = normalised_share(p)
    floor = np.zeros(n)
    frozen = np.zeros(n, dtype=bool)
    lps = 0
    while not frozen.all():
        w = job_weights(p, frozen, within)
        rising = w > 0
        lp, v = _solve_holding(p, a, floor, w.reshape(-1, 1), _extras_objective)  # share_m >= floor_m + w_m t
        lps += 1
        share = a * p.throughput(lp.X(v))
        t = max(float(np.min((share[rising] - floor[rising]) / w[rising])), 0.0)  # what X reaches for all
        floor = floor + w * t
        unit = max(float(floor.max()), 1e-3)
        stuck, used = frozen_at_level(lp, p, a, floor, w, 1e-2 * unit, WATER_RISE_REL * unit)
        lps += used
        frozen |= stuck
    # every floor held, the spare GPUs used
    lp, v = _solve_holding(p, a, floor, np.zeros((n, 0)), lambda lp: -lp.objective_x(1.0 / best_throughput(p)))
    return lp.X(v), lps + 1


def hierarchical_fairness(p: Problem) -> tuple[np.ndarray, int]:
    return hierarchical(p, "fairness")


def hierarchical_fifo(p: Problem) -> tuple[np.ndarray, int]:
    return hierarchical(p, "fifo")


def first_level(p: Problem, X: np.ndarray, within: str) -> float:
    """The first round's objective, min over the jobs with a weight of share_m / w_m^job: each entity
    at least its weight's part of the cluster, before any job is frozen (higher is better)."""
    w = job_weights(p, np.zeros(p.shape[0], dtype=bool), within)
    share = normalised_share(p) * p.throughput(X)
    return float(np.min(share[w > 0] / w[w > 0]))
