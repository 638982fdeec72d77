"""Context parallelism and the ZeRO level in the PTD-P search: a 128K-token Llama 3 405B splits its
sequences (activation memory); ZeRO-2 and ZeRO-3 peak where ZeRO-1 does (whole weights and gradients
during the step), so ZeRO-3 is taken only with reshard_after_forward (fully sharded: the shards and
about two layers whole), which plans a model whose whole stage does not fit at any t x p, if one
layer does; all of it reaches the plan file, the report and the training config."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipedream.config.plan_file import plan_from_json
from planner.config import compose, inputs_from_config
from planner.errors import DoesNotFitError, PlannerError
from planner.report import plan_table
from planner.run_line import plan_settings
from planner.search.auto import make_plan
from planner.search.ranking import GIB

LONG_CONTEXT = ["model=llama3_405b", "model.seq_len=131072", "cluster=h100_x8", "cluster.nodes=16",
                "train.global_batch_size=64"]
# two 3.4B-parameter blocks: at most p = 2 and no tensor parallelism, 13.4 GB of fp32 weights per stage
FP32_GIANT = ["model=mlp", "model.num_layers=2", "model.hidden_size=40960", "cluster=v100_16gb_x8",
              "train.global_batch_size=64", "planner.precision=fp32"]
# seven 0.2B-parameter blocks: p = 1 (7 does not split the 64 devices) and no tensor parallelism, so
# ZeRO-1 holds the whole 5.5 GiB model's weights and gradients on every device
FP32_SEVEN = ["model=mlp", "model.num_layers=7", "model.hidden_size=10240", "cluster=v100_16gb_x8",
              "train.global_batch_size=64", "planner.precision=fp32"]


@pytest.fixture(scope="module")
def long_context():
    inputs = inputs_from_config(compose(LONG_CONTEXT))
    return inputs, make_plan(inputs, simulate=False)


def test_405b_at_128k_splits_sequences_to_relieve_activation_memory(long_context):
    inputs, outcome = long_context
    best = outcome.result.best
    assert best.cp > 1 and best.fits
    assert best.pp * best.tp * best.cp * best.dp == inputs.cluster.num_devices == outcome.plan.world_size
    table = plan_table(outcome, inputs.cluster.device.flops("bf16"))
    line = next(row for row in table.splitlines() if row.strip().startswith("context parallelism"))
    assert "relieves activation memory" in line
    act = best.memory_parts["activations"]
    # the report's counterfactual: cp times the activations would not fit
    assert best.memory_bytes - act + act * best.cp > inputs.capacity
    assert f"{act * best.cp / GIB:.2f} GiB at cp=1" in line
    assert f"cp={best.cp}" in table.splitlines()[2]   # the degrees row


def test_the_long_context_plan_carries_cp_and_zero_to_the_file_and_the_run_line(long_context):
    _, outcome = long_context
    plan, best = outcome.plan, outcome.result.best
    again = plan_from_json(plan.to_json())
    assert (again.context_parallel, again.zero) == (best.cp, best.zero) and again.world_size == plan.world_size
    settings = plan_settings(plan)
    assert f"parallel.cp={best.cp}" in settings and f"optim.distributed={again.optim_distributed}".lower() in settings


def test_cp_is_searched_only_where_the_model_allows_it():
    gpt = inputs_from_config(compose(["model=gpt_1.7b"]))   # dropout 0.1: no context-parallel form
    assert gpt.cp_degrees(8) == [1]
    llama = inputs_from_config(compose(["model=llama3_8b", "model.seq_len=24"]))
    assert llama.cp_degrees(16) == [1, 2, 4]   # 2 c must divide the 24 tokens (the zigzag chunks)


def test_405b_at_128k_on_16_nodes_is_fully_sharded_with_a_plausible_memory(long_context):
    """128 H100s hold 405B only fully sharded: the 1/(d c) shards (a bf16 gradient becomes a 4-byte fp32
    shard, Adam's master, m and v 12 bytes) of the rank's p t share, two layers whole, and the
    activations full recomputation keeps (each layer's input) at 128K / c tokens."""
    inputs, outcome = long_context
    best = outcome.result.best
    assert best.fits and best.zero == 3 and best.reshard_after_forward and best.recompute
    profile = inputs.profile_at(best.tp).arrays
    stage = profile["parameter_bytes"].sum() / best.pp   # bf16 bytes of the rank's p t share
    shards = best.dp * best.cp
    parts = best.memory_parts
    block = profile["parameter_bytes"].max()
    assert parts["optimizer"] == pytest.approx(stage * 6 / shards, rel=0.02)   # 12 bytes per 2
    assert parts["gradients"] == pytest.approx(stage * 2 / shards + 2 * block, rel=0.02)
    assert parts["weights"] == pytest.approx(2 * block, rel=0.02)
    assert parts["activations"] < 0.2 * inputs.capacity


def test_fp32_layers_beyond_the_device_do_not_fit_at_any_level():
    """Each stage of one 13.4 GB block: even fully sharded ZeRO-3 holds a layer's weights and
    gradients whole, so the smallest plan is ZeRO-1's."""
    inputs = inputs_from_config(compose(FP32_GIANT))
    stage_weights = inputs.profile.arrays["parameter_bytes"].max()   # one block per stage at p = 2
    assert inputs.tp_degrees() == [1] and stage_weights > inputs.capacity - inputs.workspace
    with pytest.raises(DoesNotFitError) as deep:
        make_plan(inputs, simulate=False)
    with pytest.raises(DoesNotFitError) as shallow:
        make_plan(inputs_from_config(compose(FP32_GIANT + ["planner.max_zero=1"])), simulate=False)
    assert str(deep.value) == str(shallow.value)   # the same smallest configuration and peak


def test_fully_sharded_zero3_plans_a_model_whose_stage_does_not_fit():
    inputs = inputs_from_config(compose(FP32_SEVEN))
    with pytest.raises(DoesNotFitError):
        make_plan(inputs_from_config(compose(FP32_SEVEN + ["planner.max_zero=1"])), simulate=False)
    outcome = make_plan(inputs, simulate=False)
    best = outcome.result.best
    assert (best.pp, best.zero, best.reshard_after_forward, best.fits) == (1, 3, True, True)
    block = inputs.profile.arrays["parameter_bytes"].max()
    model = inputs.profile.arrays["parameter_bytes"].sum()
    shard = model / (best.dp * best.cp)   # fp32: the weight shard is the master copy, the gradient shard as large
    parts = best.memory_parts
    assert parts["weights"] == pytest.approx(2 * block + shard, rel=1e-6)
    assert parts["gradients"] == pytest.approx(2 * block + shard, rel=1e-6)
    assert best.breakdown["dp_comm"] > 0   # the per-layer gathers and reduce-scatters
    assert "optim.reshard_after_forward=true" in plan_settings(plan_from_json(outcome.plan.to_json()))


def test_zero3_is_taken_only_with_reshard_after_forward():
    inputs = inputs_from_config(compose([a if a != "cluster.nodes=48" else "cluster.nodes=32" for a in LONG_CONTEXT]))
    outcome = make_plan(inputs, simulate=False)
    for c in (outcome.result.best, *outcome.result.alternatives):
        assert c.zero <= 1 or (c.zero == 3 and c.reshard_after_forward), c.describe()
    best = outcome.result.best
    assert best.zero == 3 and best.fits   # 32 nodes: the fastest plan that fits is fully sharded
    assert best.between_steps_bytes < best.memory_bytes
    plan = plan_from_json(outcome.plan.to_json())
    assert plan.reshard_after_forward and "optim.reshard_after_forward=true" in plan_settings(plan)
    row = next(r for r in plan_table(outcome, 0.0).splitlines() if r.strip().startswith("ZeRO"))
    assert "reshard_after_forward" in row and "between steps" in row


def test_zero_levels_beyond_one_only_where_memory_needs_them():
    inputs = inputs_from_config(compose(["model=gpt_1.7b", "cluster=dgx_a100", "cluster.nodes=4",
                                         "train.global_batch_size=512"]))
    assert make_plan(inputs, simulate=False).result.best.zero <= 1


@pytest.mark.parametrize("args, message", [
    (["model=gpt_1.7b", "planner.cp=2"], "planner.cp=2 cannot be planned: model.dropout = 0.1"),
    (["model=llama3_8b", "planner.cp=3"], "model.seq_len = 8192 does not split into 2 x 3 equal chunks"),
    (["model=llama3_8b", "planner.max_zero=4"], "planner.max_zero = 4 must be 0, 1, 2 or 3"),
])
def test_bad_cp_and_zero_settings_are_one_line(args, message):
    with pytest.raises(PlannerError, match=message) as err:
        inputs_from_config(compose(args))
    assert "\n" not in str(err.value)


def test_docs_show_this_plan(long_context):
    """docs/planner.md's generated 405B / 128K section (python -m scripts.docs.planner) is this plan's."""
    inputs, outcome = long_context
    doc = (Path(__file__).parents[4] / "docs" / "planner.md").read_text()
    section = doc.split("<!-- long-context:start -->")[1].split("<!-- long-context:end -->")[0]
    table = plan_table(outcome, inputs.cluster.device.flops("bf16")).splitlines()
    for row in ("degrees", "memory by part", "memory per device", "context parallelism", "memory savers"):
        line = next(r for r in table if r.strip().startswith(row))
        assert line in section, f"{row!r} differs: rerun python -m scripts.docs.planner"
