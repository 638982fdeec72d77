"""``planner.memory_constraint=false``: PipeDream's search ignores device memory, as PipeDream's
released optimizer does by default, and reports the plan's memory marked over capacity; with the
constraint on, the same settings are refused in one line."""
from __future__ import annotations

import pytest

from planner.config import compose, inputs_from_config
from planner.errors import DoesNotFitError
from planner.report import plan_table
from planner.search.auto import make_plan
from planner.search.pipedream_search import pipedream_search
from tests.support.graph_txt_profiles import chain_graph, vgg16_graph

# (nodes, GPUs per node, micro-batch): VGG-16 at this micro-batch needs more than a 16 GB V100
# in every PipeDream partition on these clusters
CASES = [(1, 4, 256), (16, 8, 64)]


def _inputs(tmp_path, nodes: int, per_node: int, micro: int, constraint: bool):
    path = tmp_path / "vgg16" / "graph.txt"
    path.parent.mkdir(exist_ok=True)
    path.write_text(vgg16_graph())
    return inputs_from_config(compose([
        f"planner.graph={path}", "planner.graph_micro_batch=32", "cluster=pipedream_cluster_a",
        f"cluster.nodes={nodes}", f"cluster.devices_per_node={per_node}", "planner.algorithm=pipedream",
        "planner.pipedream_costs=released", f"planner.memory_constraint={str(constraint).lower()}",
        f"train.global_batch_size={micro}", f"train.micro_batch_size={micro}", "planner.recompute=[false]"]))


@pytest.mark.parametrize("nodes,per_node,micro", CASES)
def test_constraint_on_refuses(tmp_path, nodes, per_node, micro):
    with pytest.raises(DoesNotFitError, match="fits no PipeDream partition"):
        pipedream_search(_inputs(tmp_path, nodes, per_node, micro, True))


@pytest.mark.parametrize("nodes,per_node,micro", CASES)
def test_constraint_off_plans_over_memory_and_says_so(tmp_path, nodes, per_node, micro):
    inputs = _inputs(tmp_path, nodes, per_node, micro, False)
    outcome = make_plan(inputs, "pipedream", simulate=False)
    best = outcome.result.best
    assert best.algorithm == "pipedream" and best.micro == micro
    assert best.memory_bytes > best.capacity_bytes and not best.fits
    # the fastest partition wins: no eligible candidate is faster
    assert all(a.samples_per_s <= best.samples_per_s for a in outcome.result.alternatives)
    table = plan_table(outcome, inputs.cluster.device.flops("fp16"))
    memory_row = next(line for line in table.splitlines() if "memory per device" in line)
    assert "OVER CAPACITY" in memory_row
    assert any(n.startswith("over device memory") for n in outcome.result.notes)


def test_constraint_off_keeps_a_fitting_plan_unmarked(tmp_path):
    """Where the fastest partition fits, nothing is marked."""
    inputs = _inputs(tmp_path, 1, 4, 32, False)
    outcome = make_plan(inputs, "pipedream", simulate=False)
    assert outcome.result.best.fits
    assert "OVER CAPACITY" not in plan_table(outcome, inputs.cluster.device.flops("fp16"))
    assert not any(n.startswith("over device memory") for n in outcome.result.notes)


def test_why_lost_names_memory_of_a_slower_over_capacity_alternative():
    from planner.search.ranking import GIB, Candidate, why_lost

    def cand(rate: float, memory_gib: float) -> Candidate:
        return Candidate("pipedream", 2, 1, 1, 1, "pipedream", 8, 4, 32, False, ((0, 1, (0,)), (1, 2, (1,))),
                         32 / rate, rate, 0.0, 0.0, memory_gib * GIB, 16 * GIB, {"compute": 32 / rate})

    best = cand(100.0, 20.0)
    slower = why_lost(cand(50.0, 30.0), best)
    assert slower.startswith("100.0% slower") and slower.endswith("needs 30.0 GiB per device > 16.0 GiB")
    assert why_lost(cand(200.0, 30.0), best).startswith("100% faster but needs 30.0 GiB")
    assert "GiB per device" not in why_lost(cand(50.0, 10.0), best)
    # as fast: the sizes get the digits they need to differ, and a tie says so
    fits = cand(100.0, 10.0)
    assert why_lost(cand(100.0, 10.04), fits) == "as fast, but more memory (10.04 vs 10.00 GiB)"
    assert why_lost(cand(100.0, 10.0 + 1 / GIB), fits) == "as fast, but more memory (10.0000 vs 10.0000 GiB, +1 bytes)"
    assert why_lost(cand(100.0, 10.0), fits) == "a tie: as fast, with as much memory"


BIG_GRAPHS = {"vgg16": vgg16_graph, "chain98": chain_graph}   # 40 and 98 layers
CLUSTERS = {"4 x V100": ["cluster.devices_per_node=4"], "16 x 8 V100": ["cluster.nodes=16", "cluster.devices_per_node=8"]}


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("graph", BIG_GRAPHS)
def test_constraint_off_plans_big_graphs_with_released_costs(tmp_path, graph, cluster):
    """As ``python -m planner planner.graph=.../graph.txt cluster=pipedream_cluster_a ...
    planner.pipedream_costs=released planner.memory_constraint=false``: a plan over every layer,
    never a refusal, marked where it is over the device's memory."""
    path = tmp_path / graph / "graph.txt"
    path.parent.mkdir()
    path.write_text(BIG_GRAPHS[graph]())
    inputs = inputs_from_config(compose([f"planner.graph={path}", "cluster=pipedream_cluster_a", *CLUSTERS[cluster],
                                         "planner.pipedream_costs=released", "planner.memory_constraint=false"]))
    outcome = make_plan(inputs, "auto", simulate=False)
    best = outcome.result.best
    assert best.algorithm == "pipedream" and best.samples_per_s > 0
    assert inputs.profile.num_layers == {"vgg16": 40, "chain98": 98}[graph]
    starts, ends = [s[0] for s in best.stages], [s[1] for s in best.stages]
    assert starts[0] == 0 and starts[1:] == ends[:-1] and ends[-1] == inputs.profile.num_layers   # every layer once
    over = "OVER CAPACITY" in plan_table(outcome, inputs.cluster.device.flops("fp16"))
    assert over == (not best.fits)
