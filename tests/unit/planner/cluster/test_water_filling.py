"""Water filling on docs/cluster.md's own example (12 jobs on 8 V100 + 16 P100 + 24 K80, T from the
planner): the same lowest share as LAS, and no type left idle while a job that runs there waits."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from planner.cluster.__main__ import load_setup, problem_for
from planner.cluster.policies import allocate, effective_throughput, equal_share, validity_errors
from planner.config import compose

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def example():
    cfg = compose([f"jobs={ROOT / 'docs' / 'cluster_jobs.yaml'}", "fleet=gavel_physical"], config_name="gavel")
    fleet, table, jobs = load_setup(cfg)
    return problem_for(jobs, table.matrix(jobs), fleet)


def idle_while_waiting(p, X) -> list[tuple[int, int]]:
    """(type, job) pairs: GPUs of the type free (at least the job's scale) while the job, which can
    run there, has time left in its row."""
    free = p.counts - (X * p.scale[:, None]).sum(axis=0)
    waiting = X.sum(axis=1) < 1 - 1e-6
    return [(j, m) for j in range(p.shape[1]) for m in range(p.shape[0])
            if free[j] >= p.scale[m] - 1e-6 and waiting[m] and p.T[m, j] > 0]


def test_water_filling_on_the_docs_example(example):
    las = allocate("max_min_fairness", example)
    water = allocate("max_min_fairness_water_filling", example)
    assert validity_errors(water.X, example) == []
    assert water.objective == pytest.approx(las.objective, rel=1e-6)
    assert idle_while_waiting(example, water.X) == []
    assert water.lps >= 3  # at least one level, one spare-capacity LP and the final one
    # past the common minimum, LAS's leftover LP gives spare time to the largest total (ResNet-50s on
    # P100s stay at 1.2x their equal share); water filling raises the lowest shares first
    low_las, low_water = np.sort(shares(example, las.X)), np.sort(shares(example, water.X))
    first = np.flatnonzero(np.abs(low_las - low_water) > 1e-6 * low_las)[0]
    assert low_water[first] > low_las[first]


def shares(p, X) -> np.ndarray:
    equal = effective_throughput(p.T, equal_share(p))
    return p.scale / p.weights * effective_throughput(p.T, X) / equal
