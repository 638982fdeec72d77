"""Every registered schedule's ``ScheduleInfo`` against the action lists it builds, played out by the
simulator at unit costs (t_f = 1, t_b = 2; B = W = 1 with a split backward): bubble, peak in-flight
(micro-batch, chunk) pairs per rank and weight versions equal the descriptor's formulas for p <= 8,
m <= 32 and the vpp values the schedule allows."""
from __future__ import annotations

import math

import pytest

from pipedream.schedules import SCHEDULE_INFOS, ScheduleError, ScheduleInfo, build_schedule, schedule_info
from pipedream.schedules.simulate import Costs, simulate
from pipedream.schedules.versions import footprint, stash_versions, two_bw_versions

PPS = range(1, 9)
MICROBATCHES = (1, 2, 3, 4, 5, 7, 8, 16, 17, 31, 32)   # sampled, the edges included
ASYNC_MICROBATCHES = (1, 2, 3, 5, 8, 32)   # their runs span several steps: fewer sizes
VPPS = (1, 2, 4)
BUILT = [info for info in SCHEDULE_INFOS.values() if info.build is not None]


def unit_costs(info: ScheduleInfo) -> Costs:
    return Costs(forward=1.0, backward=2.0, weight_grad=1.0 if info.split_backward else 0.0)


def accepted(info: ScheduleInfo, microbatches=MICROBATCHES):
    """(p, m, v) the schedule builds, v counted as parallel.vpp (a V schedule's default 1 is its 2)."""
    for vpp in sorted({info.chunks(v) for v in VPPS}):
        for p in PPS:
            for m in microbatches:
                if info.accepts(p, m, vpp):
                    yield p, m, vpp


@pytest.mark.parametrize("info", [i for i in BUILT if not i.asynchronous], ids=lambda i: i.name)
def test_flush_schedules_match_their_formulas(info: ScheduleInfo) -> None:
    checked = 0
    for p, m, v in accepted(info):
        placement = info.placement_for(p, v)
        result = simulate(build_schedule(info.name, p, m, v), unit_costs(info), vpp=placement.vpp,
                          peer=placement.peer, needs=placement.needs)
        formula = float(info.bubble(p, m, v))
        slack = info.bubble_slack(p, m) / result.busy[0]   # chunk-steps over one rank's compute
        assert formula - 1e-9 <= result.bubble_fraction <= formula + slack + 1e-9, (p, m, v)
        if not info.bubble_slack(p, m):
            assert math.isclose(result.bubble_fraction, formula, abs_tol=1e-9), (p, m, v)
        assert result.peak_in_flight == [int(info.in_flight(s, p, m, v)) for s in range(p)], (p, m, v)
        checked += 1
    assert checked >= 40   # dualpipev, which needs m >= 2p, has the fewest


def steps_to_steady_state(p: int, m: int) -> int:
    """Steps after which stage 0 has held p micro-batches and p weight versions."""
    return -(-2 * p // m) + 1


@pytest.mark.parametrize("info", [i for i in BUILT if i.asynchronous], ids=lambda i: i.name)
def test_asynchronous_schedules_match_their_formulas(info: ScheduleInfo) -> None:
    """Their steady state: what one more run of steps adds is compute only (no bubble); in-flight
    and weight versions at their peak once the run is long enough."""
    for p, m, v in accepted(info, ASYNC_MICROBATCHES):
        steps = steps_to_steady_state(p, m)
        short = simulate(build_schedule(info.name, p, m, v, steps))
        long = simulate(build_schedule(info.name, p, m, v, steps + 1))
        steady = (sum(long.idle) - sum(short.idle)) / (sum(long.busy) - sum(short.busy))
        assert math.isclose(steady, float(info.bubble(p, m, v)), abs_tol=1e-9), (p, m)
        assert long.peak_in_flight == [int(info.in_flight(s, p, m, v)) for s in range(p)], (p, m)
        for stage, rank in enumerate(build_schedule(info.name, p, m, v, steps)):
            uses = stash_versions(rank) if info.updates_per_microbatch else two_bw_versions(rank, m)
            expected = info.weight_versions(info.in_flight(stage, p, m, v) / info.chunks(v))
            assert footprint(rank, uses) == expected, (p, m, stage)


@pytest.mark.parametrize("info", [i for i in BUILT if not i.asynchronous], ids=lambda i: i.name)
def test_flush_schedules_hold_one_weight_version(info: ScheduleInfo) -> None:
    for rank in build_schedule(info.name, 4, 8, info.chunks(2) if info.interleaves else info.chunks(1)):
        assert footprint(rank, stash_versions(rank)) == info.weight_versions(1) == 1


@pytest.mark.parametrize("info", BUILT, ids=lambda i: i.name)
def test_refused_sizes_are_the_builders_errors(info: ScheduleInfo) -> None:
    for p in (1, 2, 4):
        for m in (1, 3, 4, 8):
            for v in (1, 2, 3):
                try:
                    build_schedule(info.name, p, m, v)
                except ScheduleError as error:
                    with pytest.raises(ScheduleError, match="^" + str(error).replace("(", r"\(").replace(")", r"\)")
                                       .replace("[", r"\[").replace("]", r"\]").replace("*", r"\*") + "$"):
                        info.check(p, m, v)
                    assert not info.accepts(p, m, v) and "\n" not in str(error)
                else:
                    assert info.accepts(p, m, v)


def test_every_runtime_schedule_is_plannable_or_says_why() -> None:
    for info in SCHEDULE_INFOS.values():
        assert info.not_planned is None or (info.not_planned and "\n" not in info.not_planned), info.name
    assert schedule_info("dualpipev").not_planned is None


def test_an_unknown_name_is_one_line() -> None:
    with pytest.raises(ScheduleError, match=r"^schedule='zigzag' is unknown: choose one of 1f1b, 2bw, .*harmony_pp$"):
        schedule_info("zigzag")
