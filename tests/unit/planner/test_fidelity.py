"""The planner against the dissertation's statements: memory reserve (Fig. 4.17 and every fits /
out-of-memory statement), FLOP accounting, the hierarchical all-reduce (Figs. 4.14, Table 4.2),
and Table 4.1 at the paper's (t, p)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from planner.search.auto import make_plan
from planner.costs.collectives import allreduce_time, ring_time
from planner.config import compose, inputs_from_config
from planner.errors import PlannerError
from planner.search.ptdp import ptdp_search
from planner.report import count, training_time
from scripts.docs.planner_claims import GPT_5_9B, TABLE_4_1, memory_rows, plan

GIB = 1024**3
PAPER_TFLOPS = {"gpt_1.7b": 137, "gpt_3.6b": 138, "gpt_7.5b": 142, "gpt_18.4b": 135, "gpt_39.1b": 138,
                "gpt_76.1b": 140, "gpt_145.6b": 148, "gpt_310.1b": 155, "gpt_529.6b": 163, "gpt_1t": 163}


def inputs(*over):
    return inputs_from_config(compose(list(over))).as_in_the_dissertation()


def test_reserve_is_3_gib_plus_a_fifth():
    inp = inputs("model=gpt_1.7b", "cluster=dgx_a100")
    assert inp.workspace == pytest.approx(3 * GIB + 0.2 * 80 * GIB)
    assert inputs("model=gpt_1.7b", "cluster=dgx_a100", "planner.reserve_gib=0",
                  "planner.reserve_fraction=0").workspace == 0


def test_fig_4_17_recomputation_needed_at_larger_batches():
    """145.6B at (8, 16) on 128 GPUs: without recomputation only small batches fit (before the reserve,
    every batch fitted at 99% of the device); with it batch 256 runs."""
    assert not isinstance(plan(["model=gpt_145.6b"], 128, 8, 8, 16, False, 1, ("1f1b",))[0], str)
    best, _ = plan(["model=gpt_145.6b"], 128, 16, 8, 16, False, 1, ("1f1b",))
    assert isinstance(best, str) and "fits no configuration" in best
    assert not isinstance(plan(["model=gpt_145.6b"], 128, 256, 8, 16, True, 1, ("1f1b",))[0], str)


def test_every_memory_statement_agrees():
    rows = memory_rows()
    assert len(rows) >= 25
    assert [where for where, _, _, ok in rows if not ok] == []


@pytest.mark.parametrize("row", TABLE_4_1, ids=lambda r: r[0])
def test_table_4_1_at_the_papers_degrees_within_10_percent(row):
    """Hardware TFLOP/s (eq. 4.2, 4 passes) at the paper's (t, p) with recomputation, as it ran. The
    reference moved from 3-pass counts for plans without recomputation to this like-for-like count
    and the hierarchical all-reduce; the A100 efficiency was refitted to it."""
    preset, gpus, batch, t, p = row
    best, _ = plan([f"model={preset}"], gpus, batch, t, p, True)
    assert best.tflops_per_device == pytest.approx(PAPER_TFLOPS[preset], rel=0.10)


def test_hardware_and_model_flops_are_both_reported():
    """Hardware FLOPs are the passes the devices run: the forward again with recomputation (eq. 4.2),
    the model's 3 passes without."""
    inp = inputs("model=gpt_1.7b", "cluster=dgx_a100", "cluster.nodes=4", "train.global_batch_size=512")
    for rec in (False, True):
        best = ptdp_search(replace(inp, recompute=(rec,))).best
        ratio = inp.profile.flops_per_sample_recompute / inp.profile.flops_per_sample
        assert best.tflops_per_device / best.model_tflops_per_device == pytest.approx(ratio if rec else 1.0)
        assert 1.3 < ratio < 4 / 3 + 1e-9  # the forward again: 4 passes over 3, less the logits' share


def test_one_training_time_estimate_for_gpt3():
    inp = inputs("model=gpt3_175b", "cluster=dgx_a100", "cluster.nodes=128", "train.global_batch_size=1536")
    outcome = make_plan(inp, simulate=False)
    line = training_time(outcome, 300e9, 2048)
    days = float(line.split(": ")[1].split(" days")[0])
    eq44 = float(line.split("gives ")[1].split(" days")[0])
    assert eq44 == pytest.approx(days, rel=0.05)  # was 31.9 vs 24.6 (3-pass X in eq. 4.4)
    assert "300B tokens" in line


def test_parameter_counts_read_naturally():
    assert count(1.008e12) == "1.01T" and count(174.6e9) == "175B" and count(6.5e6) == "6.5M"


def test_hierarchical_allreduce_uses_every_nic():
    """5.9B, p = 2, d = 32 on DGX A100s: reduce-scatter in the node, ring over 4 nodes of 1/8 each."""
    cluster = inputs("model=gpt_1.7b", "cluster=dgx_a100", "cluster.nodes=8").cluster
    assert cluster.levels[-1].node_bandwidth == pytest.approx(8 * 25e9)
    stage = 5.9e9 / 2 * 2  # bytes of one stage's bf16 gradients
    expected = 2 * 7 / 8 * stage / 300e9 + 2 * 3 / 4 * (stage / 8) / 25e9
    assert float(allreduce_time(cluster, stage, 32, 1)) == pytest.approx(expected)
    assert float(allreduce_time(cluster, stage, 32, 1)) < float(ring_time(stage, 32, 25e9)) / 5  # 0.47 s before
    assert float(allreduce_time(cluster, stage, 4, 8)) == pytest.approx(float(ring_time(stage, 4, 25e9)))  # t = 8
    best, _ = plan(GPT_5_9B, 64, 32, 1, 2, True, 1)
    assert best.breakdown["dp_comm"] < 0.5 * best.breakdown["compute"]


def test_fig_4_14_throughput_falls_with_pipeline_depth():
    values = [plan(GPT_5_9B, 64, 128, 1, p, True, 1)[0].tflops_per_device for p in (2, 4, 8, 16)]
    assert values == sorted(values, reverse=True)


@pytest.mark.parametrize("model,mp,batch,gpus", [("gpt3_175b", (8, 12), 1536, (384, 1536)),
                                                 ("gpt_529.6b", (8, 35), 2240, (560, 2240))])
def test_table_4_2_per_gpu_throughput_loss(model, mp, batch, gpus):
    """The paper loses 7.8% (174.6B) and 7.0% (529.6B) per GPU from the fewest to the most GPUs."""
    few, many = (plan([f"model={model}"], n, batch, *mp, True, 1, ("1f1b",))[0].tflops_per_device for n in gpus)
    assert 0.05 < 1 - many / few < 0.12


def test_pinned_depth_that_splits_no_blocks_names_the_layers():
    inp = inputs("model=gpt_18.4b", "cluster=dgx_a100", "cluster.nodes=32", "train.global_batch_size=1024")
    with pytest.raises(PlannerError, match=r"planner.pp=16 does not divide the 40 repeated blocks .*42 layers") as err:
        ptdp_search(replace(inp, pin_pp=16))
    assert "\n" not in str(err.value) and "memory" not in str(err.value)
