"""A discrete-event simulator of a job trace on a heterogeneous fleet (dissertation ch. 5.7.3).

Time moves in rounds (``round_s``). A job that arrives during a round joins at the next one. The
policy is re-solved for the jobs present whenever one arrived or finished since the last solve,
and at least every ``resolve_s`` (the remaining steps change what makespan, finish-time fairness
and SLO policies want). ``mechanism="rounds"`` runs Gavel's round-based mechanism (whole rounds on
whole GPUs); ``"ideal"`` advances every job at exactly its effective throughput (the paper's ideal
baseline, Fig. 5.15b). A job that finishes inside a round completes at that moment; under
``rounds`` its GPUs then idle until the round ends, as in Gavel. Cost counts the GPU-time jobs ran
(GPUs x price per GPU-hour x hours), SLO violations the jobs finishing after arrival + SLO.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from planner.cluster.fleet import Fleet, Job, entity_arrays
from planner.cluster.mechanism import RoundMechanism
from planner.cluster.policies import Problem, allocate, effective_throughput, isolated_share
from planner.cluster.colocation import Colocation

HOUR = 3600.0


@dataclass
class SimResult:
    policy: str
    heterogeneity: str
    mechanism: str
    jct_h: np.ndarray  # per job (nan: unfinished)
    finish_h: np.ndarray
    cost: float
    busy_gpu_h: np.ndarray  # per type
    solves: int
    lps: int
    solve_s: float
    wall_s: float
    horizon_h: float
    timeline: list[tuple[float, int, float]] = field(default_factory=list)  # (hour, active jobs, GPUs busy)

    def metrics(self, jobs: Sequence[Job], window: tuple[int, int]) -> dict:
        lo, hi = window
        jct = self.jct_h[lo:hi]
        slo = np.array([j.slo_hours if j.slo_hours is not None else np.nan for j in jobs])
        has_slo = ~np.isnan(slo)
        late = has_slo & ~(self.jct_h <= slo + 1e-9)
        arrivals = np.array([j.arrival_hours for j in jobs])
        return {"policy": self.policy, "heterogeneity": self.heterogeneity, "mechanism": self.mechanism,
                "jobs": len(jobs), "window": [lo, hi], "finished": int(np.isfinite(self.jct_h).sum()),
                "avg_jct_h": float(np.nanmean(jct)) if np.isfinite(jct).any() else None,
                "median_jct_h": float(np.nanmedian(jct)) if np.isfinite(jct).any() else None,
                "unfinished_in_window": int((~np.isfinite(jct)).sum()),
                "makespan_h": float(np.nanmax(self.finish_h) - arrivals.min()) if np.isfinite(self.finish_h).all() else None,
                "cost_dollars": self.cost,
                "slo_jobs": int(has_slo.sum()), "slo_violations": int(late.sum()),
                "busy_gpu_h": self.busy_gpu_h.tolist(), "solves": self.solves, "lps": self.lps,
                "solve_s": self.solve_s, "wall_s": self.wall_s, "horizon_h": self.horizon_h}


def simulate(jobs: Sequence[Job], T: np.ndarray, fleet: Fleet, policy: str, heterogeneity: str = "aware",
             round_s: float = 360.0, resolve_s: float = 3600.0, mechanism: str = "rounds",
             max_hours: float = 24 * 365.0, colocation: Colocation | None = None) -> SimResult:
    """Run the trace ``jobs`` (rows of T in the same order) to completion or ``max_hours``;
    ``colocation``: the pairs that may share a GPU and their throughputs (space sharing)."""
    start = time.perf_counter()
    n, k = T.shape
    counts, prices = np.array(fleet.counts), np.array(fleet.prices)
    scale = np.array([j.scale_factor for j in jobs])
    arrival = np.array([j.arrival_hours for j in jobs]) * HOUR
    remaining = np.array([j.steps for j in jobs], dtype=float)
    deadline = np.array([(j.arrival_hours + j.slo_hours) * HOUR if j.slo_hours else np.inf for j in jobs])
    weights = np.array([j.weight for j in jobs])
    entity, entity_weights = (np.array(a) for a in entity_arrays(jobs))
    finish = np.full(n, np.nan)
    isolated = np.zeros(n)  # seconds the progress so far would have taken on 1/n of the cluster
    busy, cost = np.zeros(k), 0.0
    order = np.argsort(arrival, kind="stable")
    next_arrival, active = 0, []
    mech = RoundMechanism(counts)
    X = np.zeros((0, k))
    iso_thr = np.zeros(0)
    t, last_solve, changed = 0.0, -np.inf, True
    solves = lps = 0
    solve_s = 0.0
    timeline = []
    while (next_arrival < n or active) and t < max_hours * HOUR:
        while next_arrival < n and arrival[order[next_arrival]] <= t:
            active.append(int(order[next_arrival]))
            next_arrival += 1
            changed = True
        if not active:
            t = max(t + round_s, np.ceil(arrival[order[next_arrival]] / round_s) * round_s)
            continue
        rows = np.array(active)
        if changed or t - last_solve >= resolve_s:
            pairs, pair_T = colocation.among(rows) if colocation is not None else (None, None)
            problem = Problem(T[rows], counts, scale[rows], weights[rows], remaining[rows], prices,
                              elapsed_s=t - arrival[rows], isolated_s=isolated[rows],
                              deadline_s=deadline[rows] - t - round_s,  # whole rounds: aim one round early
                              pairs=pairs, pair_T=pair_T, entity=entity[rows], entity_weights=entity_weights)
            alloc = allocate(policy, problem, heterogeneity)
            X, solves, lps, solve_s = alloc.X, solves + 1, lps + alloc.lps, solve_s + alloc.solve_s
            iso_thr = np.maximum(effective_throughput(problem.T, isolated_share(problem)), 1e-300)
            mech.reset(X)
            last_solve, changed = t, False
        members, row_scale = problem.members(), problem.row_scale()
        if mechanism == "ideal":
            rate = problem.throughput(X)
            gpu_time = X * row_scale[:, None] * round_s  # GPU-seconds per (row, type) if it runs the whole round
        else:
            chosen = mech.schedule(row_scale, members)
            mech.record(chosen)
            ran = np.zeros_like(X)
            for r, j in chosen:
                ran[r, j] = 1.0
            rate = problem.throughput(ran)
            gpu_time = ran * row_scale[:, None] * round_s
        done = rate * round_s >= remaining[rows] - 1e-9
        used = np.where(done, np.divide(remaining[rows], rate, out=np.zeros(len(rows)), where=rate > 0) / round_s, 1.0)
        progress = np.minimum(rate * round_s, remaining[rows])
        row_used = np.array([max(used[m] for m in ms) for ms in members])  # a pair's GPUs run until both stop
        busy_time = gpu_time * row_used[:, None]
        busy += busy_time.sum(axis=0) / HOUR
        cost += float((busy_time * prices).sum() / HOUR)
        remaining[rows] -= progress
        isolated[rows] += progress / iso_thr
        timeline.append((t / HOUR, len(rows), float(gpu_time.sum() / round_s)))
        for m in np.flatnonzero(done):
            finish[rows[m]] = t + used[m] * round_s
            remaining[rows[m]] = 0.0
        if done.any():
            active = [a for a, d in zip(active, done) if not d]
            changed = True
        t += round_s
    jct = (finish - arrival) / HOUR
    return SimResult(policy, heterogeneity, mechanism, jct, finish / HOUR, cost, busy, solves, lps, solve_s,
                     time.perf_counter() - start, t / HOUR, timeline)
