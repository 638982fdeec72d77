"""The memory savers in the PTD-P cost model (planner.inputs.memory_options.MemoryOptions) against the anchor
paper, Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"):
activation bytes per layer of s b h (10 + 24/t + 5as/(ht)) with tensor parallelism, s b h/t (34 + 5as/h)
with sequence parallelism too, s b h (10 + 24/t) with selective recomputation, 34 s b h/t with both."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from planner.config import compose, inputs_from_config
from planner.costs.uniform import _kept_activations
from planner.inputs.memory_options import MemoryOptions
from planner.inputs.model_specs import TransformerSpec
from planner.search.auto import make_plan
from planner.report import plan_table

# the anchor paper's Table 3 models (sequence 2048, t = 8)
CONFIGS = {"22B": (48, 6144, 64), "175B": (96, 12288, 96), "530B": (105, 20480, 128), "1T": (128, 25600, 160)}
S, T = 2048, 8


def _block_columns(layers: int, hidden: int, heads: int, fused_attention: bool = False) -> dict[str, np.ndarray]:
    spec = TransformerSpec("anchor", "gpt", layers, hidden, heads, S, 51200, precision="fp16",
                           fused_attention=fused_attention)
    block = spec.layer_specs(T)[1]
    return {name: np.array([getattr(block, name)], dtype=float) for name in
            ("activation_bytes", "activation_bytes_recompute", "sequence_shardable_bytes", "attention_core_bytes")}


@pytest.mark.parametrize("name", CONFIGS)
def test_per_layer_activation_memory_is_the_anchor_papers(name):
    layers, h, a = CONFIGS[name]
    col = _block_columns(layers, h, a)
    sbh = S * h   # per sample (b = 1), fp16 bytes
    anchor = {
        (False, False): sbh * (10 + 24 / T + 5 * a * S / (h * T)),
        (True, False): sbh / T * (34 + 5 * a * S / h),
        (False, True): sbh * (10 + 24 / T),
        (True, True): 34 * sbh / T,
    }
    rec = np.array([True])
    for (sequence_parallel, selective), expected in anchor.items():
        kept, _ = _kept_activations(col, rec, False, MemoryOptions(selective=selective,
                                                                   sequence_parallel=sequence_parallel), T)
        assert kept[0] == pytest.approx(expected, rel=0.05)
        assert kept[0] == pytest.approx(expected, rel=1e-12)   # the formula itself, not an approximation of it
    full, working = _kept_activations(col, rec, True, MemoryOptions(sequence_parallel=True), T)
    assert full[0] == pytest.approx(2 * sbh / T)   # full recomputation keeps the layer's (sharded) input


@pytest.mark.parametrize("name", CONFIGS)
def test_a_fused_attention_kernel_keeps_no_scores_so_selective_recomputation_saves_only_its_statistic(name):
    layers, h, a = CONFIGS[name]
    col = _block_columns(layers, h, a, fused_attention=True)
    sbh, rec = S * h, np.array([True])
    statistic = 4 * a * S / T   # the kernel's fp32 log-sum-exp per head and position, this rank's heads
    for sequence_parallel, expected in ((False, sbh * (10 + 24 / T)), (True, 34 * sbh / T)):
        options = MemoryOptions(sequence_parallel=sequence_parallel)
        kept, _ = _kept_activations(col, rec, False, options, T)
        assert kept[0] == pytest.approx(expected + statistic, rel=1e-12)
        selective, _ = _kept_activations(col, rec, False, replace(options, selective=True), T)
        assert selective[0] == pytest.approx(expected, rel=1e-12)   # the anchor's selective figure


def test_the_dissertations_inputs_count_the_stored_scores_and_the_default_does_not():
    inputs = inputs_from_config(compose(["model=gpt3_175b", "cluster=dgx_a100", "cluster.nodes=2",
                                         "train.global_batch_size=64"]))
    paper = inputs.as_in_the_dissertation()
    assert inputs.spec.fused_attention and not paper.spec.fused_attention
    fused, stored = (x.profile.arrays["activation_bytes"] for x in (inputs, paper))
    assert (stored >= fused).all() and (stored > fused).any()   # the 5as/h term, only in the paper's


def test_the_distributed_optimizer_divides_optimizer_state_by_d():
    inputs = inputs_from_config(compose(["model=gpt_1.7b", "cluster=dgx_a100", "cluster.nodes=4",
                                         "train.global_batch_size=512"]))
    from planner.costs.uniform import rank_stats
    profile = inputs.profile_at(2)
    common = (profile, inputs.cluster, 2, 2, 1, 8, False, np.array([1.0]))
    plain = rank_stats(*common)
    sharded = rank_stats(*common, options=MemoryOptions(optimizer_shards=8))
    np.testing.assert_allclose(sharded.optimizer_bytes * 8, plain.optimizer_bytes)
    np.testing.assert_allclose(sharded.param_bytes, plain.param_bytes)


def test_gpt3_on_1024_a100s_is_planned_with_the_savers_and_says_which():
    inputs = inputs_from_config(compose(["model=gpt3_175b", "cluster=dgx_a100", "cluster.nodes=128",
                                         "train.global_batch_size=1536"]))
    assert inputs.selective_recompute and inputs.sequence_parallel and inputs.distributed_optimizer
    outcome = make_plan(inputs, "auto", "strict", False)
    plan, best = outcome.plan, outcome.result.best
    assert plan.recompute in ("none", "full", "selective")
    assert (plan.sequence_parallel, plan.distributed_optimizer) == (best.sequence_parallel, best.distributed_optimizer)
    assert plan.to_json()["sequence_parallel"] == plan.sequence_parallel
    assert plan.sequence_parallel == (plan.parallel.tp > 1)   # free in the model where it applies
    assert plan.parallel.dp > 1 or not plan.distributed_optimizer
    text = plan_table(outcome, inputs.cluster.device.flops("bf16"))
    assert f"recomputation          {plan.recompute}" in text and "memory savers" in text
    # without them (the dissertation's options) the same search plans no better
    baseline = make_plan(inputs.as_in_the_dissertation(), "auto", "strict", False).result.best
    assert best.samples_per_s >= baseline.samples_per_s * (1 - 1e-9)


@pytest.mark.parametrize("recompute, selective, layers", [(False, False, None), (True, False, 1), (False, True, None)])
def test_the_search_shards_the_optimizer_as_rank_stats_does(recompute, selective, layers):
    """The PTD-P search sums the layers once and divides the optimizer state for the distributed
    optimizer (``with_optimizer_shards``): every field equals ``rank_stats`` under the sharded options."""
    from dataclasses import fields

    from planner.costs.uniform import rank_stats
    from planner.search.ptdp import with_optimizer_shards
    inputs = inputs_from_config(compose(["model=gpt_1.7b", "cluster=dgx_a100", "cluster.nodes=4",
                                         "train.global_batch_size=512"]))
    profile = inputs.profile_at(2)
    common = (profile, inputs.cluster, 2, 2, 2, 8, recompute, np.array([1.0, 2.0, 4.0]))
    base = MemoryOptions(selective=selective, sequence_parallel=True, grad_bucket_bytes=2.0**20, recompute_layers=layers)
    for shards in (1, 8):
        options = replace(base, optimizer_shards=shards)
        derived, direct = with_optimizer_shards(rank_stats(*common, options=base), options), rank_stats(*common, options=options)
        for f in fields(direct):
            a, b = getattr(derived, f.name), getattr(direct, f.name)
            assert np.array_equal(a, b) if isinstance(b, np.ndarray) else a == b, f.name
