"""planner.algorithm=auto: which search, why, and the simulator check of the winner."""
from __future__ import annotations

from dataclasses import replace

import pytest

from pipedream.devices import DEVICES
from planner.search.auto import choose_algorithm, make_plan
from planner.inputs.hardware import Cluster, Level
from planner.inputs.search_inputs import Inputs
from planner.inputs.model_specs import TransformerSpec, mlp, vgg16
from planner.search.pipedream_search import pipedream_search
from planner.inputs.profile import analytic_profile

A100 = DEVICES["a100_80gb"]


def node(count=8, nodes=2, device=A100):
    return Cluster("c", device, (Level("nv", count, 300e9, 5e-6), Level("ib", nodes, 25e9, 1e-5)), count)


def test_auto_picks_ptdp_for_transformers():
    spec = TransformerSpec("g", "gpt", 16, 2048, 16, 1024, 51200, "bf16")
    inputs = Inputs("g", analytic_profile(spec, A100), node(), 64, spec)
    algorithm, why = choose_algorithm(inputs)
    assert algorithm == "ptdp" and "ch. 4.3" in why
    assert choose_algorithm(replace(inputs, spec=None), "relaxed")[0] == "2bw"


def test_auto_picks_pipedream_for_cnns():
    inputs = Inputs("vgg16", analytic_profile(vgg16(), DEVICES["v100_16gb"]), node(4, 2, DEVICES["v100_16gb"]), 256)
    algorithm, why = choose_algorithm(inputs)
    assert algorithm == "pipedream" and "ch. 2.4.1" in why


def test_flush_plan_is_simulated_and_matches_the_formula_when_balanced():
    """Equal blocks, free messages: the simulator's bubble is exactly (p-1)/m and 1F1B keeps p - s in flight."""
    spec = mlp(8, 256)
    cluster = Cluster("c", A100, (Level("nv", 4, 1e18),), 4)
    inputs = Inputs("mlp", analytic_profile(spec, A100), cluster, 32, None, schedules=("1f1b",),
                    recompute=(False,), micro_batch=1)
    out = make_plan(inputs, "ptdp")
    sim = out.sim
    assert sim.ran, sim.note
    assert sim.peak_in_flight == sim.peak_in_flight_formula
    if out.plan.parallel.pp > 1:
        assert sim.bubble_simulated == pytest.approx(sim.bubble_formula, rel=1e-6)
    assert out.plan.world_size == 4


def test_forced_pipeline_simulation_interleaved():
    spec = mlp(8, 256)
    cluster = Cluster("c", A100, (Level("nv", 4, 1e18),), 4)
    inputs = Inputs("mlp", analytic_profile(spec, A100), cluster, 8, None, schedules=("interleaved",),
                    recompute=(False,), micro_batch=1, max_tp=1)
    from planner.search.auto import _sim_check
    result = make_plan(inputs, "ptdp").result
    inter = [c for c in (result.best, *result.alternatives) if c.schedule == "interleaved" and c.pp == 4]
    assert inter, "an interleaved 4-stage configuration is among the ranked ones"
    sim = _sim_check(inputs, inter[0])
    assert sim.ran and sim.bubble_simulated == pytest.approx(sim.bubble_formula, rel=1e-6)
    assert sim.peak_in_flight == sim.peak_in_flight_formula


def test_pipedream_plan_replicates_stages_and_is_simulated():
    device = DEVICES["v100_16gb"]
    inputs = Inputs("vgg16", analytic_profile(vgg16(), device), node(4, 4, device), 256)
    out = make_plan(inputs)
    plan = out.plan
    assert plan.schedule == "pipedream" and plan.world_size == 16
    assert sorted(r for st in plan.stages for r in st.ranks) == list(range(16))
    assert out.sim.ran or "not in pipedream.schedules" in out.sim.note
    if out.sim.ran:
        assert out.sim.peak_in_flight == out.sim.peak_in_flight_formula
    baseline = [a for a in out.result.alternatives if a.algorithm == "data-parallel"]
    assert baseline and baseline[0].iteration_time > out.result.best.iteration_time  # pipelining pays off


def test_straight_pipeline_option():
    device = DEVICES["v100_16gb"]
    inputs = Inputs("vgg16", analytic_profile(vgg16(), device), Cluster("c", device, (Level("p", 4, 1e10),), 4),
                    64, replication=False)
    best = pipedream_search(inputs).best
    assert best.pp == 4 and all(len(r) == 1 for _, _, r in best.stages)
