"""The simulator check of replicated PipeDream plans: the steady rate over whole rounds."""
from __future__ import annotations

import pytest

from planner.check.simcheck_async import check_replicated


@pytest.mark.parametrize("replicas,forward,backward", [
    ((16, 1), [16.0, 0.1], [32.0, 0.1]),   # 16 input replicas, one cheap output stage: completions in bursts of 16
    ((4, 1), [4.0, 0.1], [8.0, 0.1]),
    ((2, 1), [2.0, 1.0], [4.0, 2.0]),     # balanced: each stage 3 per micro-batch
])
def test_the_steady_rate_is_the_slowest_stages_when_nothing_else_waits(replicas, forward, backward):
    """The input stage takes (F + B) / replicas = 3 per micro-batch; the output stage's completions
    arrive in bursts, and a window cutting a burst (or holding the fill's) read 2.33 for (16, 1)."""
    check = check_replicated(replicas, forward, backward, [0.0] * len(replicas), 3.0, 1e18, 0.0)
    assert check.ran
    assert check.per_input_simulated == pytest.approx(3.0, rel=1e-9)
