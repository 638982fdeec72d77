"""``planner.pipedream_costs=released`` reproduces PipeDream's released optimizer
(``optimizer_graph_hierarchical.py``, msr-fiddle/pipedream) on its own graph.txt profiles.

The expected values are what that optimizer printed for the same graph.txt files (written by
``tests/support/graph_txt_profiles.py``) with ``--use_fewer_machines``, no memory constraint and no activation
compression ratio, so boundaries cost nothing (docs/planner.md,
PipeDream's released optimizer): per stage the compute time of its layers (seconds per mini-batch of
32) and its replication factor, and "Time per stage in pipeline". Where layers cost nothing (ReLU,
MaxPool, View) the released optimizer places a boundary anywhere among them (its choice follows the
iteration order of a set of objects, which differs between its runs), so the stages are compared by
compute time and replicas, not by layer index.
"""
from __future__ import annotations

import pytest

from planner.config import compose, inputs_from_config
from planner.search.pipedream_search import pipedream_search
from tests.support.graph_txt_profiles import alexnet_graph, vgg16_graph

# (graph, nodes, GPUs per node) -> (per stage: compute s, replicas), time per stage s; the released
# optimizer ran with -n 4 4 -b 12e9 1.25e9 (Cluster-A's PCIe and Ethernet) or -n 16 -b 1.25e9
RELEASED = {
    ("vgg16", 4, 4): ([(0.09045, 4), (0.088785, 4), (0.053271, 4), (0.035514, 2), (0.017758, 1), (0.011252, 1)],
                      0.02267754),
    ("alexnet", 4, 4): ([(0.00565, 4), (0.002153, 4), (0.002871, 4), (0.001914, 3), (0.001125, 1)], 0.001495172),
    ("alexnet", 16, 1): ([(0.00565, 5), (0.002153, 1), (0.002871, 6), (0.001914, 1), (0.001125, 1)], 0.002153),
}
GRAPHS = {"vgg16": vgg16_graph, "alexnet": alexnet_graph}


@pytest.mark.parametrize("case", sorted(RELEASED))
def test_released_costs_reproduce_the_released_optimizer(case, tmp_path):
    model, nodes, per_node = case
    path = tmp_path / model / "graph.txt"
    path.parent.mkdir()
    path.write_text(GRAPHS[model]())
    inputs = inputs_from_config(compose([
        f"planner.graph={path}", "planner.graph_micro_batch=32", "cluster=pipedream_cluster_a",
        f"cluster.nodes={nodes}", f"cluster.devices_per_node={per_node}", "planner.algorithm=pipedream",
        "planner.pipedream_costs=released", "planner.memory_constraint=false", "planner.fewer_devices=true",
        "planner.activation_compression_ratio=null",
        "train.global_batch_size=32", "train.micro_batch_size=32", "planner.recompute=[false]"]))
    best = pipedream_search(inputs).best
    forward, backward = inputs.profile.times(32)
    compute = forward + backward
    stages = [(float(compute[start:end].sum()), len(ranks)) for start, end, ranks in best.stages]
    expected, per_input = RELEASED[case]
    assert [r for _, r in stages] == [r for _, r in expected]
    assert [t for t, _ in stages] == pytest.approx([t for t, _ in expected], rel=1e-5)
    assert best.iteration_time * 32 / best.global_batch == pytest.approx(per_input, rel=1e-6)
