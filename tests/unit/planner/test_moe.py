"""Mixture-of-experts models in the planner: parameter memory with the routed experts split over ep
ranks, compute from the active parameters, the all-to-alls on the link the ep group spans (hidden
only by DualPipe-V's paired micro-batches), expert gradients reduced over d c / ep ranks, ep in the
search and in the plan file."""
from __future__ import annotations

import json
import time
from dataclasses import replace

import numpy as np
import pytest

from pipedream.config.plan_config import apply_plan
from pipedream.config.plan_file import PlanError, load_plan, plan_from_json
from planner.__main__ import run
from planner.config import cluster_for, compose, inputs_from_config
from planner.costs.collectives import allreduce_time
from planner.errors import PlannerError
from pipedream.config.layout import ParallelLayout
from planner.costs.all_to_all import alltoall_exposed, alltoall_seconds, ep_span
from planner.costs.uniform import rank_stats, reduction_seconds
from planner.inputs.model_specs import LlamaSpec
from planner.inputs.profile import analytic_profile
from planner.search.auto import make_plan
from tests.support.training_harness import compose_config

H100 = cluster_for(compose(["cluster=h100_x8", "cluster.nodes=2"]).cluster)   # 8 per node, 16 in all
MOE = (("num_experts", 8), ("top_k", 2))
B = np.array([1.0, 2.0])


def mixtral_like(moe=MOE, ffn: int = 14336) -> LlamaSpec:
    return LlamaSpec("mixtral_like", 4, 4096, 32, 8, ffn, 4096, 32000, moe_keys=moe)


def stats(ep: int, d: int = 8, c: int = 1, recompute: bool = False):
    profile = analytic_profile(mixtral_like(), H100.device, 1)
    return rank_stats(profile, H100, 1, 2, 1, d, recompute, B, c=c, ep=ep)


def test_a_rank_holds_one_ep_th_of_the_routed_experts():
    one, four = stats(1), stats(4)
    experts = one.expert_param_bytes
    assert experts.all() and (experts < one.param_bytes).all()
    np.testing.assert_allclose(four.expert_param_bytes, experts / 4)
    np.testing.assert_allclose(one.param_bytes - four.param_bytes, experts * 3 / 4)
    np.testing.assert_allclose(one.optimizer_bytes - four.optimizer_bytes, one.expert_optimizer_bytes * 3 / 4)
    np.testing.assert_array_equal(four.activation_bytes, one.activation_bytes)   # each token is the same work


def test_compute_counts_the_active_experts_only():
    moe, dense = mixtral_like().layer_specs(1)[1], mixtral_like((), ffn=2 * 14336).layer_specs(1)[1]
    s, h = 4096, 4096
    # top_k = 2 experts of width 14336 are one SwiGLU of 28672 plus the router's h x 8 matrix
    assert moe.forward_flops - dense.forward_flops == 2 * s * h * 8
    assert moe.parameters - dense.parameters == 6 * 3 * h * 14336 + h * 8   # but all 8 experts are held
    assert moe.expert_parameters == 8 * 3 * h * 14336
    spec = mixtral_like()
    assert spec.num_active_parameters() < spec.num_parameters() == sum(x.parameters for x in spec.layer_specs(1))
    assert not spec.allows_tp(2) and spec.max_tp == 1   # the MoE runtime trains at tp = 1


def test_the_alltoall_crosses_the_link_the_ep_group_spans():
    col = analytic_profile(mixtral_like(), H100.device, 1).arrays
    share = np.array([1.0])
    moved = col["alltoall_bytes"].max()
    assert moved == 4096 * 2 * 4096 * 2   # s x top_k x h x bf16, per sample and direction
    intra, inter = H100.levels[0], H100.levels[-1]
    # the group covers t ep consecutive ranks whatever c is (``test_the_ep_span_is_the_runtimes``)
    for ep, c, level in ((8, 1, intra), (4, 2, intra), (8, 2, intra), (2, 8, intra), (16, 1, inter)):
        forward, backward = alltoall_seconds(col, H100, 1, c, ep, share, None)
        one = moved * (ep - 1) / ep / level.bandwidth + level.latency
        assert forward.max() == pytest.approx(2 * one) and backward.max() == pytest.approx(2 * one)
        assert (forward[0][col["alltoall_bytes"] == 0] == 0).all()   # embedding and head move nothing
    assert not alltoall_seconds(col, H100, 1, 1, 1, share, None)[0].any()   # ep = 1: every expert is local
    forward, _ = alltoall_seconds(col, H100, 1, 1, 8, share, col["alltoall_bytes"] > 0)
    assert forward.max() == pytest.approx(2 * alltoall_seconds(col, H100, 1, 1, 8, share, None)[0].max())


@pytest.mark.parametrize("t, c, d, ep", [(1, 1, 8, 8), (1, 2, 4, 2), (1, 2, 4, 4), (1, 4, 2, 8), (2, 2, 2, 4),
                                        (2, 1, 8, 4), (1, 8, 2, 16), (4, 2, 1, 2)])
def test_the_ep_span_is_the_runtimes(t, c, d, ep):
    """The runtime's expert-parallel groups (``ParallelLayout.expert_groups``) are blocks of t ep
    consecutive ranks aligned to their size, so with 8 devices a node one lies inside a node exactly
    when t ep <= 8, which is the link ``alltoall_seconds`` prices."""
    layout = ParallelLayout(pp=2, dp=d, cp=c, tp=t, ep=ep)
    for pp_rank in range(2):
        for tp_rank in range(t):
            for group in layout.expert_groups(pp_rank, tp_rank)[0]:
                first = min(group) - tp_rank
                assert max(group) - first + 1 <= ep_span(t, ep) and first % ep_span(t, ep) == 0
                assert (first // 8 == max(group) // 8) == (ep_span(t, ep) <= 8)
    level = H100.level_for_span(ep_span(t, ep))
    assert level is (H100.levels[0] if t * ep <= 8 else H100.levels[-1])


def test_dualpipev_hides_the_alltoall_behind_the_other_directions_compute():
    st = stats(8)
    forward, backward = st.alltoall
    np.testing.assert_allclose(alltoall_exposed(st, "1f1b"), forward + backward)
    np.testing.assert_allclose(alltoall_exposed(st, "zbv"), forward + backward)   # zbv pairs nothing
    assert not alltoall_exposed(st, "dualpipev").any()   # NVLink's exchange is shorter than the compute
    slow = replace(st, alltoall=(forward + 2 * st.backward, backward + st.forward / 2))
    np.testing.assert_allclose(alltoall_exposed(slow, "dualpipev"), forward + st.backward)


def test_expert_gradients_reduce_over_the_ranks_holding_the_same_experts():
    st = stats(4, d=4, c=2)
    experts = st.expert_param_bytes
    expected = allreduce_time(H100, st.param_bytes - experts, 8, 1) + allreduce_time(H100, experts, 2, 4)
    np.testing.assert_allclose(reduction_seconds(st, H100, 4), expected)
    dense = rank_stats(analytic_profile(mixtral_like(()), H100.device, 1), H100, 1, 2, 1, 4, False, B, c=2)
    np.testing.assert_allclose(reduction_seconds(dense, H100, 4), allreduce_time(H100, dense.param_bytes, 8, 1))


def test_ep_is_searched_for_moe_models_only():
    moe = inputs_from_config(compose(["model=mixtral_8x7b", "cluster=h100_x8", "cluster.nodes=2"]))
    assert moe.ep_degrees(8) == [1, 2, 4, 8] and moe.ep_degrees(6) == [1, 2] and moe.tp_degrees() == [1]
    dense = inputs_from_config(compose(["model=llama3_8b", "cluster=h100_x8", "cluster.nodes=2"]))
    assert dense.ep_degrees(8) == [1] and dense.profile.num_experts == 0


def test_a_pinned_tp_above_1_is_refused_for_moe_models_in_one_line():
    inputs = inputs_from_config(compose(["model=mixtral_8x7b", "cluster=h100_x8", "cluster.nodes=2", "planner.tp=2"]))
    with pytest.raises(PlannerError, match="planner.tp=2 cannot be honoured for mixtral_8x7b: MoE models train at tp = 1") \
            as err:
        make_plan(inputs, "ptdp")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("argv, ep_max", [(["model=mixtral_8x7b", "cluster=h100_x8", "cluster.nodes=2"], 8),
                                          (["model=qwen2_moe_a2.7b", "cluster=h100_x8", "cluster.nodes=1"], 8)])
def test_the_presets_plan_fast_and_show_ep_and_active_parameters(argv, ep_max, capsys, tmp_path):
    start = time.perf_counter()
    assert run([*argv, f"planner.out={tmp_path / 'plan.json'}"]) == 0
    assert time.perf_counter() - start < 5   # a second each on a laptop; slack for a loaded test machine
    text = capsys.readouterr().out
    plan = load_plan(tmp_path / "plan.json")
    assert 1 < plan.expert_parallel <= ep_max and plan.parallel.tp == 1
    assert f"ep={plan.expert_parallel}  (" in text and " active, " in text and "expert parallelism" in text
    assert f"parallel.ep={plan.expert_parallel}" in text
    written = json.loads((tmp_path / "plan.json").read_text())
    assert written["expert_parallel"] == plan.expert_parallel
    assert written["planner"]["active_parameters"] < plan.model.num_parameters


def plan_dict(**over):
    """gpt_tiny (the default config's model) on pp 2 x dp 2."""
    from models.facts import parameter_count
    stages = [{"layers": [0, 2], "replicas": 2, "ranks": [0, 1]}, {"layers": [2, 6], "replicas": 2, "ranks": [2, 3]}]
    return {"version": 1, "model": {"name": "gpt_tiny", "num_layers": 6,
                                    "num_parameters": parameter_count(compose_config([]).model)},
            "cluster": {"name": "local_cpu", "num_devices": 4, "devices_per_node": 4},
            "parallel": {"pp": 2, "tp": 1, "dp": 2, "vpp": 1}, "schedule": "gpipe",
            "batch": {"global": 32, "micro": 8, "num_microbatches": 2}, "recompute": "none", "stages": stages,
            "predicted": {}, **over}


def test_expert_parallel_round_trips_and_applies_as_parallel_ep(tmp_path):
    plan = plan_from_json(plan_dict(expert_parallel=2))
    plan.save(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json") == plan and plan.expert_parallel == 2
    planned = apply_plan(compose_config([f"parallel.plan={tmp_path / 'plan.json'}"]))
    assert planned.parallel.ep == 2 and planned.parallel.dp == 2


def test_older_plans_load_with_ep_1_and_bad_ep_is_one_line(tmp_path):
    assert plan_from_json(plan_dict()).expert_parallel == 1
    (tmp_path / "old.json").write_text(json.dumps(plan_dict()))
    assert apply_plan(compose_config([f"parallel.plan={tmp_path / 'old.json'}"])).parallel.ep == 1
    for bad in (3, 0, True, "2"):
        with pytest.raises(PlanError, match="plan expert_parallel = .* must be an integer >= 1 dividing dp\\*cp = 2") \
                as err:
            plan_from_json(plan_dict(expert_parallel=bad))
        assert "\n" not in str(err.value)
