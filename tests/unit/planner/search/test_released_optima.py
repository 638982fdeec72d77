"""``planner.pipedream_costs=released`` is PipeDream's released optimizer
(``optimizer_graph_hierarchical.py``) on its own VGG-16 and AlexNet profiles: for every topology of
``tests/data/pipedream_released/released_optima.tsv`` (its README says how the table was made) the
planner finds the released optimum, prices the released optimizer's plan at that optimum, and
reports for its own plan exactly what pricing that plan gives; straight pipelines on more GPUs than
layers are refused in one line, as the released optimizer stops."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from planner.config import compose, inputs_from_config
from planner.errors import PlannerError
from planner.search.pipedream_dp import price_plan
from planner.search.pipedream_search import dp_options, pipedream_search

DATA = Path(__file__).resolve().parents[3] / "data" / "pipedream_released"
CASES = list(csv.DictReader((DATA / "released_optima.tsv").open(), delimiter="\t"))


def case_id(row: dict) -> str:
    return f"{row['profile']}-{row['gpus_per_server_x_servers']}-{'straight' if row['straight'] == 'True' else 'replicated'}"


def planner_inputs(row: dict):
    """The command of the data's README: per server x servers GPUs at 1.25e10 / 1.25e9 B/s, b = 1."""
    per_server, servers = map(int, row["gpus_per_server_x_servers"].split("x"))
    straight = row["straight"] == "True"
    return inputs_from_config(compose([
        f"planner.graph={DATA / (row['profile'] + '_linear.txt')}", "planner.graph_micro_batch=1",
        "cluster=pipedream_cluster_a", f"cluster.nodes={servers}", f"cluster.devices_per_node={per_server}",
        "cluster.levels.0.bandwidth_gbit_s=100", "cluster.levels.1.bandwidth_gbit_s=10",
        "planner.algorithm=pipedream", "planner.pipedream_costs=released", "planner.memory_constraint=false",
        f"planner.replication={str(not straight).lower()}", "planner.recompute=[false]",
        "train.micro_batch_size=1", f"train.global_batch_size={math.lcm(*range(1, per_server * servers + 1))}"]))


def test_the_table_has_every_case():
    assert len(CASES) == 16 and sum(row["released_optimum_s"] != "None" for row in CASES) == 12


@pytest.mark.parametrize("row", [r for r in CASES if r["released_optimum_s"] != "None"], ids=case_id)
def test_the_released_optimum_and_its_price(row):
    inputs = planner_inputs(row)
    optimum = float(row["released_optimum_s"])
    best = pipedream_search(inputs).best
    reported = best.iteration_time * best.micro / best.global_batch   # seconds per input
    assert reported == pytest.approx(optimum, rel=1e-6)
    options = dp_options(inputs)
    released_plan = json.loads(row["released_plan_flat[start,end,replicas]"])
    assert price_plan(inputs.profile, inputs.cluster, 1, released_plan, options) == pytest.approx(optimum, rel=1e-6)
    own_plan = [(start, end, len(ranks)) for start, end, ranks in best.stages]
    assert price_plan(inputs.profile, inputs.cluster, 1, own_plan, options) == pytest.approx(reported, rel=1e-9)
    assert sum(len(ranks) for _, _, ranks in best.stages) == inputs.cluster.num_devices  # no --use_fewer_machines


@pytest.mark.parametrize("row", [r for r in CASES if r["released_optimum_s"] == "None"], ids=case_id)
def test_a_straight_pipeline_on_more_gpus_than_layers_is_refused(row):
    with pytest.raises(PlannerError, match=r"straight pipeline needs a layer per device: \d+ layers < 128 devices"):
        pipedream_search(planner_inputs(row))
