"""The launcher's memory pre-check: analytic bytes per term, summed over this machine's processes."""
from __future__ import annotations

import pytest

from launcher.memory_check import (FP32, GIB, RUNTIME_BYTES_PER_PROCESS, check_memory, estimate_memory,
                                   for_model_set, microbatches_in_flight, optimizer_states, weight_versions)
from models import build_model
from pipedream.errors import ConfigError
from pipedream.config.run_spec import build_run_spec
from pipedream.config.specs import OptimSpec
from pipedream.schedules import schedule_info
from tests.support.training_harness import compose_config

GPT_1_7B = ["model.num_layers=24", "model.hidden_size=2304", "model.num_heads=24", "model.seq_len=2048",
            "model.vocab_size=51200"]


def estimate(overrides: list[str], processes: int = 2):
    from omegaconf import OmegaConf
    cfg = compose_config(overrides)
    spec = build_run_spec(cfg, processes)
    return estimate_memory(OmegaConf.to_container(cfg.model), spec, processes), cfg, spec


def test_optimizer_states_and_weight_versions():
    assert optimizer_states(OptimSpec("adamw", 0.0, True, "torch", False, betas=(0.9, 0.95), eps=1e-8)) == 2
    assert optimizer_states(OptimSpec("sgd", 0.0, True, "torch", False, momentum=0.9)) == 1
    assert optimizer_states(OptimSpec("sgd", 0.0, True, "torch", False, momentum=0.0)) == 0
    one_f_one_b, two_bw, pipedream = schedule_info("1f1b"), schedule_info("2bw"), schedule_info("pipedream")
    assert weight_versions(one_f_one_b, 4, 8) == 1 and weight_versions(two_bw, 4, 8) == 2
    assert weight_versions(pipedream, 4, 8) == 4
    assert microbatches_in_flight(schedule_info("gpipe"), 2, 8) == 8
    assert microbatches_in_flight(one_f_one_b, 4, 8) == (4 + 3 + 2 + 1) / 4
    assert microbatches_in_flight(one_f_one_b, 4, 2) == (2 + 2 + 2 + 1) / 4


def test_interleaved_holds_its_warm_up_chunks():
    """Megatron's warm-up: stage i holds min(2 (pp - i - 1) + (v - 1) pp + 1, m v) chunks of 1/v of a
    stage each (measured on the schedule's actions by tests/unit/schedules/test_infos.py), more than
    1F1B's min(pp - i, m)."""
    chunks = [min(2 * (4 - i - 1) + 4 + 1, 16) for i in range(4)]   # pp = 4, v = 2, m = 8
    assert microbatches_in_flight(schedule_info("interleaved"), 4, 8, 2) == sum(chunks) / 2 / 4


def test_weights_match_the_built_model_and_terms_scale():
    """The default job (pp = 2): the weight term is the real model's parameter count in fp32, plus
    the tied embedding's second copy on the last stage; gradients equal it, AdamW doubles it."""
    adamw, cfg, _ = estimate([])
    built = sum(p.numel() for p in build_model(cfg.model).build_sequential().parameters())
    tied_copy = cfg.model.vocab_size * cfg.model.hidden_size
    assert adamw.weights == pytest.approx((built + tied_copy) * FP32, rel=0.001)
    assert adamw.gradients == adamw.weights and adamw.optimizer == 2 * adamw.weights
    assert adamw.runtime == 2 * RUNTIME_BYTES_PER_PROCESS
    sgd, _, _ = estimate(["optim=sgd"])
    assert sgd.optimizer == sgd.weights and sgd.activations == adamw.activations
    full, _, _ = estimate(["recompute.granularity=full"])
    assert full.activations < adamw.activations / 5
    selective, _, _ = estimate(["recompute.granularity=selective"])
    assert full.activations < selective.activations < adamw.activations   # only the attention cores dropped
    dp2, _, _ = estimate(["parallel.pp=1", "parallel.dp=2"])
    assert dp2.weights == pytest.approx(2 * adamw.weights)   # two whole replicas on this machine
    gpipe, _, _ = estimate(["schedule=gpipe"])
    assert gpipe.activations == pytest.approx(adamw.activations * 8 / 1.5)   # m = 8 vs 1F1B's (2 + 1) / 2


def test_zero_levels_and_cp_as_held_at_the_peak():
    """Every level shards the optimizer state over dp x cp; whole gradients and parameters are held
    during the step (zero3's reshard_after_forward holds the shards and two layers whole, the stage
    whole under a split backward); cp divides activations."""
    layout = ["parallel.pp=1", "parallel.dp=2", "optim=adamw"]
    plain, _, _ = estimate(layout)
    for level in ("zero1", "zero2", "zero3"):
        zero, _, _ = estimate(layout + [f"optim.distributed={level}"])
        assert zero.optimizer == pytest.approx(plain.optimizer / 2), level
        assert (zero.weights, zero.gradients) == (plain.weights, plain.gradients), level
    interleaved = ["parallel.pp=2", "parallel.dp=1", "schedule=interleaved", "parallel.vpp=2", "optim=adamw",
                   "optim.distributed=zero3"]
    whole, _, _ = estimate(interleaved)
    resharded, cfg, spec = estimate(interleaved + ["optim.reshard_after_forward=true"])
    from planner.inputs.model_specs import spec_from_config
    from omegaconf import OmegaConf
    layers = spec_from_config({**OmegaConf.to_container(cfg.model), "precision": "fp32"}).layer_specs(1)
    two = [sorted((layers[i].parameters * FP32 for s, e in spec.bounds[rank::2] for i in range(s, e)),
                  reverse=True)[:2] for rank in range(2)]
    layers_whole = sum(sum(pair) for pair in two) / 2 * 2   # averaged over the 2 stages, 2 processes
    assert resharded.weights == pytest.approx(whole.weights + layers_whole)   # dp = 1: the shard is the stage
    assert resharded.gradients == pytest.approx(whole.gradients + layers_whole)
    sharded, _, _ = estimate(["parallel.pp=1", "parallel.dp=2", "optim=adamw", "optim.distributed=zero3",
                              "optim.reshard_after_forward=true"])
    assert sharded.weights < plain.weights and sharded.gradients < plain.gradients
    assert sharded.optimizer == pytest.approx(plain.optimizer / 2)
    split, _, _ = estimate(["parallel.pp=2", "parallel.dp=1", "schedule=zb_h2", "optim=adamw",
                            "optim.distributed=zero3", "optim.reshard_after_forward=true"])
    assert split.weights == pytest.approx(2 * whole.weights)   # the stage whole beside its (dp = 1) shard
    split, _, _ = estimate(["parallel.pp=1", "parallel.cp=2", "model.dropout=0", "optim=adamw",
                            "optim.distributed=zero1"])
    assert split.activations == pytest.approx(plain.activations / 2)
    assert split.optimizer == pytest.approx(plain.optimizer / 2)


def test_large_model_is_refused_with_the_numbers_in_one_line():
    _, cfg, spec = estimate(GPT_1_7B)
    with pytest.raises(ConfigError) as error:
        check_memory("gpt_1.7b", cfg, spec, 2, available=23.4 * GIB)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("model=gpt_1.7b needs about ") and "2 processes: weights 6.6, gradients 6.6, " \
        "optimizer 13.2" in message and "but 23.4 GiB is available" in message


def test_default_job_fits_and_cuda_is_skipped():
    _, cfg, spec = estimate([])
    assert check_memory("gpt_tiny", cfg, spec, 2, available=2 * GIB) is None
    _, big, big_spec = estimate(GPT_1_7B + ["cluster.device=cuda"])
    assert "skipped for cluster.device=cuda" in check_memory("gpt_1.7b", big, big_spec, 2, available=GIB)


def test_a_fused_model_set_holds_k_models():
    single, cfg, _ = estimate([])
    fused = for_model_set(estimate(["train.models=4"])[0], compose_config(["train.models=4"]))
    assert fused.weights == 4 * single.weights and fused.activations == 4 * single.activations
    assert fused.runtime == single.runtime
    assert for_model_set(single, cfg) == single


def test_sequence_parallelism_keeps_a_tth_of_the_layernorm_and_dropout_regions():
    """At tp = 2 each rank keeps what the planner prices: the sequence-shardable part of every layer
    halves with parallel.sequence_parallel, the rest (the tensor-parallel GEMMs' share) does not."""
    from omegaconf import OmegaConf
    from planner.inputs.model_specs import spec_from_config

    plain, cfg, _ = estimate(["parallel.pp=1", "parallel.tp=2"])
    sharded, _, _ = estimate(["parallel.pp=1", "parallel.tp=2", "parallel.sequence_parallel=true"])
    layers = spec_from_config({**OmegaConf.to_container(cfg.model), "precision": "fp32"}).layer_specs(2)
    kept = sum(layer.activation_bytes for layer in layers)
    shardable = sum(layer.sequence_shardable_bytes for layer in layers)
    assert shardable > 0
    assert sharded.activations / plain.activations == pytest.approx((kept - shardable / 2) / kept)


def test_recomputing_the_first_layers_of_each_stage_keeps_the_rest():
    none, _, _ = estimate([])
    full, _, _ = estimate(["recompute.granularity=full"])
    first, _, _ = estimate(["recompute.granularity=full", "recompute.num_layers=2"])
    assert full.activations < first.activations < none.activations
    zero, _, _ = estimate(["recompute.granularity=full", "recompute.num_layers=0"])
    assert zero.activations == pytest.approx(none.activations)


def test_an_elastic_job_whose_fewest_nodes_cannot_hold_the_model_is_refused_with_the_devices_it_needs():
    from launcher.elastic_memory import check_smallest_world
    from pipedream.config.elastic import ElasticSpec
    cfg = compose_config([*GPT_1_7B, "parallel.pp=4", "parallel.dp=1", "train.micro_batch_size=1",
                          "train.global_batch_size=8"])
    one_node = estimate_memory(dict(cfg.model), build_run_spec(cfg, 4), 1).total   # a quarter of the model
    with pytest.raises(ConfigError, match=r"launcher.min_nodes = 1: on 1 devices .* the model needs 2 devices "
                                          r"\(2 nodes\): set launcher.min_nodes=2"):
        check_smallest_world("gpt_1.7b", cfg, ElasticSpec(1, 4), 1, lambda c, w: build_run_spec(c, w),
                             available=one_node * 2.5)   # half the model fits, the whole does not
    check_smallest_world("gpt_1.7b", cfg, ElasticSpec(2, 4), 1, lambda c, w: build_run_spec(c, w),
                         available=one_node * 2.5)
