"""The planner's bubble and memory of the zero-bubble schedules agree with the simulator, and a
search allowed to pick them does when they are faster at the same memory."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from pipedream.devices import DEVICES
from pipedream.schedules import SCHEDULE_INFOS, build_schedule, schedule_info, schedule_placement
from pipedream.schedules.simulate import Costs, simulate
from planner.costs import closed_form as cost
from planner.costs import zero_bubble

SPLIT_BACKWARD = tuple(name for name, info in SCHEDULE_INFOS.items() if info.split_backward)
from planner.inputs.hardware import Cluster, Level
from planner.inputs.search_inputs import Inputs
from planner.inputs.model_specs import TransformerSpec
from planner.inputs.profile import analytic_profile
from planner.search.ptdp import ptdp_search
from planner.check.simcheck import check_uniform
from planner.costs.uniform import rank_stats


@pytest.mark.parametrize("name", SPLIT_BACKWARD)
def test_formulas_match_the_simulated_order(name: str) -> None:
    for p in (1, 2, 3, 4, 5, 8):
        for m in sorted(k for k in {1, p, 2 * p - 1, 2 * p, 3 * p, 32} if schedule_info(name).accepts(p, k)):
            placement = schedule_placement(name, p)
            result = simulate(build_schedule(name, p, m), Costs(forward=1.0, backward=2.0, weight_grad=1.0),
                              vpp=placement.vpp, peer=placement.peer, needs=placement.needs)
            formula = float(cost.bubble_fraction(name, p, m))
            if not schedule_info(name).bubble_slack(p, m):
                assert math.isclose(result.bubble_fraction, formula, abs_tol=1e-9), (p, m)
            else:   # the formula is the fill; the order may add up to 2 chunk-steps (4p of them for m < p)
                slack = (2 if m >= 2 * p else 4 * p) / (6 * m)
                assert formula - 1e-9 <= result.bubble_fraction <= formula + slack, (p, m)
            flight = [float(cost.in_flight(name, p, s, m)) * placement.vpp for s in range(p)]
            assert result.peak_in_flight == flight, (p, m)


def test_against_1f1b() -> None:
    p, m = 8, np.array([8.0, 16.0, 32.0])
    assert np.allclose(cost.bubble_fraction("zb_h2", p, m), cost.bubble_fraction("1f1b", p, m) / 3)
    assert np.allclose(cost.bubble_fraction("zbv", p, m), cost.bubble_fraction("1f1b", p, m) / 6)
    assert cost.in_flight("zbv", p, 3, 32) == cost.in_flight("1f1b", p, 0, 32)    # 1F1B's stage-0 memory
    assert cost.in_flight("zb_h2", p, 3, 32) == 2 * p - 1


def small_inputs(schedules: tuple[str, ...]) -> Inputs:
    spec = TransformerSpec("t", "gpt", 8, 64, 4, 16, 64, "fp32")
    device = replace(DEVICES["v100_16gb"], half_efficiency_flops=1e6)
    cluster = Cluster("c", device, (Level("nv", 8, 1e9),), 8)
    return Inputs("t", analytic_profile(spec, device, 1), cluster, 64, None, reserve_gib=0.0, reserve_fraction=0.0,
                  schedules=schedules, pin_pp=4)


def test_search_picks_a_zero_bubble_schedule_when_allowed() -> None:
    only_1f1b = ptdp_search(small_inputs(("1f1b",))).best
    best = ptdp_search(small_inputs(("1f1b", "zb_h2", "zbv"))).best
    assert schedule_info(best.schedule).split_backward
    assert best.iteration_time < only_1f1b.iteration_time and best.bubble_fraction < only_1f1b.bubble_fraction


def test_the_simulator_check_runs_them() -> None:
    inputs = small_inputs(("zbv",))
    stats = rank_stats(inputs.profile_at(1), inputs.cluster, 1, 4, 1, 2, False, np.array([4.0]))
    for name in SPLIT_BACKWARD:
        check = check_uniform(name, stats, 0, 8, math.inf, 0.0)
        assert check.ran, check.note
        assert check.peak_in_flight == check.peak_in_flight_formula
        assert abs(check.bubble_simulated - check.bubble_formula) < 0.1, check


def test_zbv_needs_two_blocks_per_rank() -> None:
    assert zero_bubble.fits("zbv", 4, 8) and not zero_bubble.fits("zbv", 4, 6) and zero_bubble.fits("zb_h2", 4, 4)
    spec = TransformerSpec("t", "gpt", 4, 64, 4, 16, 64, "fp32")
    inputs = replace(small_inputs(("1f1b", "zbv")), profile=analytic_profile(spec, DEVICES["v100_16gb"], 1))
    assert ptdp_search(inputs).best.schedule == "1f1b"     # 4 blocks cannot make 8 chunks on 4 ranks


def test_a_schedule_the_planner_cannot_plan_is_one_line_with_its_reason(capsys) -> None:
    from planner.__main__ import main as planner_main

    assert planner_main(["model=gpt_tiny", "cluster=local_cpu", "planner.schedules=[1f1b,harmony_pp]"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: planner.schedules=")
    assert schedule_info("harmony_pp").not_planned in err
    assert planner_main(["model=gpt_tiny", "cluster=local_cpu", "planner.schedules=[zigzag]"]) == 2
    assert "no cost model for zigzag" in capsys.readouterr().err


def test_dualpipev_is_planned_with_its_own_bubble_and_memory() -> None:
    best = ptdp_search(small_inputs(("dualpipev",))).best
    assert best.schedule == "dualpipev" and best.pp == 4
    assert math.isclose(best.bubble_fraction, 3 / (6 * best.num_microbatches))
    assert cost.in_flight("dualpipev", 4, 0, 8) == 4.5   # 2p + 1 chunks of half a stage
