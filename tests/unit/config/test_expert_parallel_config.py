"""``parallel.ep``: the degree reaches the layout without changing the world size, and its groups
are a stage's consecutive dp x cp replicas (exchange) and every ep-th of them (same experts); what
experts split over ep ranks cannot run is refused in one ``ConfigError`` line while the config is read."""
from __future__ import annotations

import pytest

from pipedream.config.layout import ParallelLayout
from pipedream.config.run_spec import build_run_spec
from pipedream.errors import ConfigError
from tests.distributed.test_moe_training import MIXTRAL
from tests.support.training_harness import compose_config

BASE = [*(o for o in MIXTRAL if not o.startswith("parallel.pp")), "parallel.pp=1", "parallel.dp=2", "parallel.ep=2"]


def test_the_degree_reaches_the_layout_and_leaves_the_world_size() -> None:
    spec = build_run_spec(compose_config(BASE), 2)
    assert (spec.layout.ep, spec.layout.world_size) == (2, 2)


@pytest.mark.parametrize("overrides, overlaps", [
    ([], False), (["schedule=dualpipev", "parallel.pp=2"], True),
    (["schedule=dualpipev", "parallel.pp=2", "parallel.ep_overlap=false"], False),
    (["schedule=dualpipev", "parallel.pp=2", "parallel.ep=1"], False)])
def test_the_overlap_is_on_where_the_schedule_pairs_and_experts_split(overrides, overlaps) -> None:
    assert build_run_spec(compose_config(BASE + ["train.global_batch_size=16"] + overrides)).ep_overlap is overlaps


def test_expert_groups_are_taken_from_a_stages_data_and_context_parallel_ranks() -> None:
    layout = ParallelLayout(pp=2, dp=2, cp=2, tp=1, ep=2)   # stage 1: ranks 4..7 (dp-major, cp-minor)
    assert layout.expert_groups(1, 0) == ([[4, 5], [6, 7]], [[4, 6], [5, 7]])
    assert ParallelLayout(pp=1, dp=4, ep=4).expert_groups(0, 0) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])


@pytest.mark.parametrize("overrides, rule", [
    (["model=gpt_tiny"], "parallel.ep=2 but model=gpt has no MoE layers"),
    (["model.moe.num_experts=0"], "parallel.ep=2 but model=llama has no MoE layers"),
    (["parallel.ep=3", "parallel.dp=3"], "parallel.ep=3 does not divide model.moe.num_experts=4"),
    (["parallel.dp=1"], "parallel.ep=2 does not divide parallel.dp*cp=1"),
    (["parallel.tp=2"], "model.moe has no tensor-parallel form but parallel.tp=2"),
    (["optim.distributed=zero2"], "optim.distributed=zero2 with parallel.ep=2 is not supported"),
    (["optim.distributed=zero3"], "optim.distributed=zero3 with parallel.ep=2 is not supported"),
    (["optim.distributed=zero1", "precision=fp16"], "precision=fp16 with optim.distributed=zero1 and parallel.ep=2"),
    (["schedule=pipedream", "parallel.pp=2"], "schedule=pipedream with parallel.ep=2 is not supported"),
    (["parallel.ep=0"], "parallel.ep = 0 must be a positive integer"),
    (["parallel.ep_overlap=true"], "parallel.ep_overlap=true needs a schedule that pairs a forward with another "
                                   "chunk's backward (dualpipev; got schedule=1f1b)"),
    (["parallel.ep_overlap=sometimes"], "parallel.ep_overlap='sometimes' must be auto, true or false"),
])
def test_what_cannot_run_is_refused_in_one_line(overrides, rule) -> None:
    base = [o for o in BASE if not o.startswith(("model=", "model.moe."))] if "model=gpt_tiny" in overrides else BASE
    with pytest.raises(ConfigError) as error:
        build_run_spec(compose_config(base + overrides))
    assert rule in str(error.value) and "\n" not in str(error.value)
