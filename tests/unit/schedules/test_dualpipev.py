"""DualPipe-V as data: complete, matched, deadlock-free under the simulator (unit and uneven costs
with latency) and NCCL's stream rules for every p <= 8 and 2p <= m <= 32; its order against zbv's;
run by the executor over a loopback like one nn.Sequential."""
from __future__ import annotations

import pytest
import torch

from pipedream.schedules import Action, Kind, ScheduleError, build_schedule, schedule_placement
from pipedream.schedules.issue_order import issue_order
from pipedream.schedules.channels import check_channel_order
from pipedream.schedules.simulate import Costs, simulate
from pipedream.schedules.stream_model import check_stream_order
from tests.support.loopback import LoopbackNetwork, run_ranks
from tests.support.schedule_checks import check_compute, check_local_handover
from tests.unit.runtime.test_executor import blocks, reference
from tests.unit.runtime.test_zero_bubble_executor import data, layout_of, zero_bubble_rank

UNIT = Costs(forward=1.0, backward=2.0, weight_grad=1.0)   # F = B = W = 1 per chunk


def run(pp: int, m: int, costs: Costs = UNIT):
    placement = schedule_placement("dualpipev", pp)
    schedule = build_schedule("dualpipev", pp, m)
    return schedule, placement, simulate(schedule, costs, vpp=placement.vpp, peer=placement.peer,
                                         needs=placement.needs)


@pytest.mark.parametrize("pp", range(1, 9))
def test_every_size_is_complete_matched_and_near_zbv(pp: int) -> None:
    for m in range(2 * pp, 33):
        where = f"pp={pp} m={m}"
        schedule, placement, result = run(pp, m)
        check_compute(schedule, m, 2)
        check_local_handover(schedule, placement)
        check_channel_order(schedule, pp, 2, placement.peer)
        assert all(actions[-2:] == [Action(Kind.SYNC_GRADS), Action(Kind.STEP)] for actions in schedule), where
        assert 6 * m + pp - 1 <= result.iteration_time, where   # never shorter than the fill allows
        if m in (2 * pp, 2 * pp + 1, 32):   # ZB-V's iteration, within a few chunk-steps
            zbv = simulate(build_schedule("zbv", pp, m), UNIT, vpp=2, peer=placement.peer, needs=placement.needs)
            assert result.iteration_time <= zbv.iteration_time + pp, where
        # one (micro-batch, chunk) pair more in flight than ZB-V's 2p, on every rank
        assert result.peak_in_flight == [2 * pp + 1] * pp, where


def test_other_costs_latency_and_stream_rules_never_deadlock() -> None:
    costs = Costs(forward=1.0, backward=2.5, weight_grad=0.7, latency=0.3, act_bytes=2.0, grad_bytes=2.0,
                  bandwidth=4.0)
    for pp in range(1, 9):
        for m in sorted({2 * pp, 2 * pp + 1, 3 * pp, 17, 32}):
            schedule, placement, result = run(pp, m, costs)
            assert all(abs(b - m * 2 * 3.5) < 1e-9 for b in result.busy), (pp, m)
            orders = [issue_order(actions) for actions in schedule]
            for streams in ("direction", "channel"):
                check_stream_order(orders, pp, 2, streams=streams, peer=placement.peer, needs=placement.needs)


def test_the_phases_at_two_ranks() -> None:
    """Rank 0: F0 F0 (warm-up), F0 F1, B1 W1 F1 (zero bubble), F0 B1 F1 B0 pairs, whole backwards."""
    compute = [str(a) for a in build_schedule("dualpipev", 2, 4)[0] if a.kind in (Kind.FWD, Kind.BWD, Kind.WEIGHT)]
    assert compute[:9] == ["F0", "F1", "F2", "F0.1", "B0.1", "W0.1", "F1.1", "F3", "B1.1"]
    assert compute[-3:] == ["W2", "B3", "W3"]


def test_bad_sizes_are_one_line() -> None:
    with pytest.raises(ScheduleError, match="needs microbatches >= 2 \\* pp = 8"):
        build_schedule("dualpipev", 4, 7)
    with pytest.raises(ScheduleError, match="exactly 2 chunks"):
        build_schedule("dualpipev", 4, 8, 3)


@pytest.mark.parametrize("fused", [True, False])
def test_executor_runs_it_like_one_sequential(fused: bool) -> None:
    layout = layout_of("dualpipev", 2)
    layers, batches = blocks(4), data(4)
    network = LoopbackNetwork(layout)
    ranks = run_ranks(lambda rank: zero_bubble_rank(rank, layout, "dualpipev", layers, network, batches, fused), 2)
    loss_sum, expected = reference(layers, batches)
    assert ranks[0][0].loss_sum == pytest.approx(loss_sum, rel=1e-6)
    grads = [g for vs in range(4) for g in next(r[1][vs] for r in ranks if vs in r[1])]
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    predicted = run(2, 4)[2]
    assert [r[2].stats.peak_in_flight for r in ranks] == predicted.peak_in_flight
