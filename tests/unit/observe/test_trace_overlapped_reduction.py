"""The trace report's costs when gradient buckets left during the backward (``R`` events before
SYNC_GRADS): the buckets' channel time goes to the simulator as the overlapped reduction and SYNC
keeps only what followed the last bucket; a blocking reduction's buckets stay inside SYNC."""
from __future__ import annotations

import pytest

from pipedream.observe.trace import RankTrace, StepTrace, TraceEvent
from pipedream.observe.trace_report import measured_costs, predict


def _rank(buckets: list[tuple[float, float]], sync: tuple[float, float]) -> RankTrace:
    events = [TraceEvent("F0", "F", 0, 0, 0.0, 1.0), TraceEvent("B0", "B", 0, 0, 1.0, 3.0),
              TraceEvent("SYNC", "SYNC", -1, 0, *sync), TraceEvent("STEP", "STEP", -1, 0, sync[1], sync[1] + 0.1)]
    events += [TraceEvent(f"R{i}", "R", -1, i, start, end) for i, (start, end) in enumerate(buckets)]
    return RankTrace(0, 0, 0, [StepTrace(1, origin=0.0, end=sync[1] + 0.1, events=events)])


def test_overlapped_buckets_become_the_simulators_reduction():
    # bucket 0 leaves mid-backward and takes 1.0; bucket 1 queues behind it until 3.5, then 0.5 more
    costs = measured_costs([_rank([(2.0, 3.0), (2.5, 3.5)], sync=(3.0, 3.7))])
    assert costs.grad_reduce == {(0, 0): pytest.approx(1.5)} and costs.grad_buckets == {(0, 0): 2}
    assert costs.sync == pytest.approx(0.2)   # SYNC's part after the last bucket ended
    sim = predict("1f1b", 1, 1, 1, costs, weight_grads_delay=1)
    # one rank, F 1 + B 2: buckets ready at 2 and 3 (evenly over B), 0.75 each -> end 3.75, + 0.2
    assert sim.iteration_time == pytest.approx((3.0 + 0.75 + 0.2 + 0.1) * 1e3)


def test_blocking_buckets_stay_in_sync():
    costs = measured_costs([_rank([(3.0, 3.4), (3.4, 3.8)], sync=(3.0, 3.9))])
    assert costs.grad_reduce == {} and costs.sync == pytest.approx(0.9)
    assert costs.costs().grad_reduce == 0.0
