"""Synthetic job traces modelled on Gavel's workload (dissertation ch. 5.7.1).

* Job kinds are drawn uniformly from a mix of (model, batch) pairs (Gavel: 26 kinds from Table 5.2;
  here the ``conf/model`` presets the planner can plan, ``trace.mix`` in conf/gavel.yaml).
* Duration on the reference type (Gavel: a V100) is 10^x minutes, x ~ U[1.5, 3] with probability
  0.8 and U[3, 4] otherwise; steps = duration x the job's throughput there (from T, so the planner's).
* GPUs per job: all 1 ("continuous-single"), or 70% 1, 25% 2-4, 5% 8 ("continuous-multiple",
  Microsoft's published traces). A mix entry's batch is per GPU, as for Gavel's data-parallel
  workers: a job on k GPUs trains k x batch samples per step.
* Arrivals: Poisson with ``rate_per_hour`` jobs per hour ("continuous"); rate 0: all at time 0
  ("static").
* Optional SLOs (the cost experiment, ch. 5.7.3): a factor from ``slo_factors`` x the job's
  duration on the reference type.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping, Sequence

import numpy as np

from planner.errors import PlannerError
from planner.cluster.fleet import Job


def scale_factors(rng: np.random.Generator, n: int, multi_gpu: bool) -> np.ndarray:
    if not multi_gpu:
        return np.ones(n, dtype=int)
    draw = rng.random(n)
    return np.where(draw < 0.70, 1, np.where(draw < 0.95, rng.integers(2, 5, n), 8))


def durations_minutes(rng: np.random.Generator, n: int) -> np.ndarray:
    short = rng.random(n) < 0.8
    return 10 ** np.where(short, rng.uniform(1.5, 3.0, n), rng.uniform(3.0, 4.0, n))


def generate_trace(mix: Sequence[Mapping], n: int, rate_per_hour: float, seed: int, multi_gpu: bool,
                   reference_steps_per_s: Callable[[Job], float], slo_factors: Sequence[float] = ()) -> list[Job]:
    """``n`` jobs; ``reference_steps_per_s(job)`` is the job's throughput on the reference type."""
    if n < 1:
        raise PlannerError(f"trace.jobs = {n} must be >= 1")
    if rate_per_hour < 0:
        raise PlannerError(f"trace.rate_per_hour = {rate_per_hour} must be >= 0 (0: every job at time 0)")
    if not mix:
        raise PlannerError("trace.mix is empty: list (model, batch) pairs, e.g. [{model: resnet50, batch: 32}]")
    rng = np.random.default_rng(seed)
    kinds = rng.integers(0, len(mix), n)
    scales = scale_factors(rng, n, multi_gpu)
    minutes = durations_minutes(rng, n)
    gaps = rng.exponential(1.0 / rate_per_hour, n) if rate_per_hour > 0 else np.zeros(n)
    arrivals = np.cumsum(gaps) - gaps[0]
    slos = rng.choice(np.asarray(slo_factors, dtype=float), n) if len(slo_factors) else None
    jobs = []
    for i in range(n):
        kind = mix[int(kinds[i])]
        job = Job(name=f"job{i}", model=str(kind["model"]), batch=int(kind["batch"]) * int(scales[i]), steps=1.0,
                  scale_factor=int(scales[i]), arrival_hours=float(arrivals[i]))
        steps = minutes[i] * 60.0 * reference_steps_per_s(job)
        hours = minutes[i] / 60.0
        jobs.append(replace(job, steps=float(steps),
                            slo_hours=float(slos[i] * hours) if slos is not None else None))
    return jobs
