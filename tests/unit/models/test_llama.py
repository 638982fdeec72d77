"""model=llama: the Llama 3 presets have Llama 3's parameter counts, the FLOP formula counts the
GEMMs the model runs, bad configurations fail in one line, and the planner plans Llama 3 70B."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

from models import build_model, check_tensor_parallel_config
from models.attention import selectively_recompute
from models.errors import ConfigError
from models.facts import flops_per_iteration, parameter_count
from models.families.llama import rope_inverse_frequencies
from models.families.llama_facts import check_llama_config, kv_heads_per_rank
from planner.config import compose, inputs_from_config
from planner.inputs.model_specs import spec_from_config
from planner.search.auto import make_plan

CONF = Path(__file__).resolve().parents[3] / "conf" / "model"
TINY = yaml.safe_load((CONF / "llama_tiny.yaml").read_text())
# Meta's model cards: 8.03B, 70.6B and 405.9B parameters (405B's card says 405.9B in the paper's table)
LLAMA3 = {"llama3_8b": 8.03e9, "llama3_70b": 70.6e9, "llama3_405b": 405.9e9}


@pytest.mark.parametrize("preset", LLAMA3)
def test_llama3_presets_have_llama3_parameter_counts(preset):
    cfg = yaml.safe_load((CONF / f"{preset}.yaml").read_text())
    assert parameter_count(cfg) == pytest.approx(LLAMA3[preset], rel=1e-3)
    assert spec_from_config(cfg).num_parameters() == parameter_count(cfg)


def test_llama_tiny_counts_its_built_parameters_and_gqa_shrinks_k_and_v():
    network = build_model(TINY).build_sequential()
    assert parameter_count(TINY) == sum(p.numel() for p in network.parameters())
    attn = network[1].self_attn
    assert attn.k_proj.weight.shape == (TINY["num_kv_heads"] * 32, TINY["hidden_size"])
    assert attn.q_proj.weight.shape == (TINY["hidden_size"], TINY["hidden_size"])
    assert not any(name.endswith("bias") for name, _ in network.named_parameters())
    assert selectively_recompute(network) == TINY["num_layers"]   # one attention core per block


def test_the_flop_formula_counts_the_gemms_the_model_runs():
    """FlopCounterMode counts every GEMM of the forward and backward (it does not see the CPU's
    fused attention kernel, so eq. 4.2's attention term 4 s^2 h per layer is added to what it counts)."""
    cfg, batch, seq = {**TINY, "num_layers": 2}, 2, TINY["seq_len"]
    network = build_model(cfg).build_sequential()
    tokens = torch.randint(cfg["vocab_size"], (batch, seq))
    attention = 4 * seq * seq * cfg["hidden_size"] * cfg["num_layers"] * batch
    with FlopCounterMode(display=False) as forward:
        logits = network(tokens)
    assert forward.get_total_flops() + attention == flops_per_iteration(cfg, batch, False) / 3
    with FlopCounterMode(display=False) as total:
        network(tokens).sum().backward()
    assert total.get_total_flops() + 3 * attention == flops_per_iteration(cfg, batch, False)
    assert flops_per_iteration(cfg, batch, True) == pytest.approx(4 / 3 * flops_per_iteration(cfg, batch, False),
                                                                  rel=0.1)
    assert logits.shape == (batch, seq, cfg["vocab_size"])


def test_llama3_rope_scaling_slows_only_the_long_wavelengths():
    plain = rope_inverse_frequencies(128, 500000.0, None)
    scaled = rope_inverse_frequencies(128, 500000.0, {"factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    wavelength = 2 * torch.pi / plain
    assert torch.equal(scaled[wavelength < 8192 / 4], plain[wavelength < 8192 / 4])
    torch.testing.assert_close(scaled[wavelength > 8192], plain[wavelength > 8192] / 8)
    between = (wavelength > 8192 / 4) & (wavelength < 8192)
    assert between.any() and bool(((scaled[between] < plain[between]) & (scaled[between] > plain[between] / 8)).all())


@pytest.mark.parametrize("change,message", [
    ({"num_kv_heads": 3}, r"^model.num_kv_heads=3 does not divide model.num_heads=4: "),
    ({"num_heads": 3, "num_kv_heads": 1}, r"^model.num_heads=3 does not divide model.hidden_size=128: "),
    ({"hidden_size": 120, "num_heads": 8, "num_kv_heads": 8}, r"^model.hidden_size / model.num_heads = 15 is odd"),
    ({"rope_scaling": {"factor": 8.0}}, r"^model.rope_scaling lacks low_freq_factor, high_freq_factor, "),
])
def test_bad_llama_configs_fail_in_one_line(change, message):
    with pytest.raises(ConfigError, match=message) as error:
        check_llama_config({**TINY, **change}, 1)
    assert "\n" not in str(error.value)


def test_key_value_heads_split_or_replicate_over_tensor_parallel_ranks():
    assert [kv_heads_per_rank(32, 8, t) for t in (1, 2, 4, 8, 16, 32)] == [8, 4, 2, 1, 1, 1]
    check_tensor_parallel_config({**TINY, "num_kv_heads": 1}, 4)   # one head on every rank
    for cfg, tp, message in [({**TINY, "num_heads": 8, "num_kv_heads": 4, "hidden_size": 256}, 8, None),
                             ({**TINY, "num_heads": 12, "num_kv_heads": 4, "hidden_size": 384}, 6,
                              r"^model.num_kv_heads=4 and parallel.tp=6 neither divide the other: "),
                             (TINY, 8, r"^model.num_heads=4 is not divisible by parallel.tp=8: "),
                             ({**TINY, "ffn_hidden_size": 350}, 4, r"^model.ffn_hidden_size=350 is not divisible ")]:
        if message is None:
            check_tensor_parallel_config(cfg, tp)
            continue
        with pytest.raises(ConfigError, match=message):
            check_tensor_parallel_config(cfg, tp)
    spec = spec_from_config({**TINY, "num_heads": 12, "num_kv_heads": 4, "hidden_size": 384, "ffn_hidden_size": 768})
    assert [t for t in (1, 2, 3, 4, 6, 12) if spec.allows_tp(t)] == [1, 2, 4, 12]


def test_the_planner_plans_llama3_70b_on_64_a100s():
    inp = inputs_from_config(compose(["model=llama3_70b", "cluster=dgx_a100", "cluster.nodes=8",
                                      "train.global_batch_size=1024"]))
    assert inp.cluster.num_devices == 64 and inp.spec.seq_len == 8192
    plan = make_plan(inp, simulate=False).plan
    parallel = plan.parallel
    assert parallel.pp * parallel.tp * plan.context_parallel * parallel.dp == 64 and 8 % parallel.tp == 0
    assert plan.batch.global_batch == 1024
    assert plan.model.num_parameters == parameter_count(yaml.safe_load((CONF / "llama3_70b.yaml").read_text()))
    assert plan.predicted.memory_bytes_per_device <= plan.predicted.memory_capacity_bytes
    # model FLOPs per device from the GQA + SwiGLU formula, over the predicted iteration time
    model_flops = flops_per_iteration(yaml.safe_load((CONF / "llama3_70b.yaml").read_text()), 1024, False)
    assert plan.planner["model_tflops_per_device"] == pytest.approx(
        model_flops / plan.predicted.iteration_time_s / 64 / 1e12, rel=1e-6)
