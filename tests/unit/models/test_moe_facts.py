"""model.moe's torch-free facts: the MoE presets have the published total and active parameter
counts, the FLOP count follows the active parameters, the planner's per-block facts, and every
broken rule of model.moe is one ConfigError line."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from models.errors import ConfigError
from models.facts import flops_per_sample, parameter_count
from models.families.llama_facts import check_llama_config, check_llama_tensor_parallel, llama_active_parameter_count
from models.families.moe_facts import MOE_DEFAULTS, moe_block_facts, moe_config

CONF = Path(__file__).resolve().parents[3] / "conf" / "model"
# (total, active) as published, each with the unit of its last digit: Mistral AI's announcements
# (46.7B / 12.9B, 141B / 39B) and Qwen's model card (14.3B / 2.7B "activated", embeddings and head
# included)
PUBLISHED = {"mixtral_8x7b": ((46.7e9, 1e8), (12.9e9, 1e8)), "mixtral_8x22b": ((141e9, 1e9), (39e9, 1e9)),
             "qwen2_moe_a2.7b": ((14.3e9, 1e8), (2.7e9, 1e8))}


def preset(name: str) -> dict:
    return yaml.safe_load((CONF / f"{name}.yaml").read_text())


def matches_published(count: int, published: tuple[float, float]) -> bool:
    """Within 0.1%, or, as the figures are given to 2 or 3 digits, rounding to the published one."""
    value, unit = published
    return abs(count - value) <= max(1e-3 * value, unit / 2)


@pytest.mark.parametrize("name", PUBLISHED)
def test_moe_presets_have_the_published_total_and_active_counts(name):
    cfg = preset(name)
    total, active = PUBLISHED[name]
    assert matches_published(parameter_count(cfg), total), parameter_count(cfg)
    assert matches_published(llama_active_parameter_count(cfg), active), llama_active_parameter_count(cfg)
    check_llama_config(cfg, 1)


def test_mixtral_8x7b_total_is_within_a_tenth_of_a_percent():
    assert parameter_count(preset("mixtral_8x7b")) == pytest.approx(46.7e9, rel=1e-3)


def test_a_dense_llama_is_unchanged_by_an_absent_or_empty_moe():
    tiny = preset("llama_tiny")
    assert moe_config(tiny) is None
    assert parameter_count({**tiny, "moe": {"num_experts": 0}}) == parameter_count(tiny) \
        == llama_active_parameter_count(tiny)


def test_one_expert_top_one_counts_as_the_dense_model_plus_its_router():
    tiny = preset("llama_tiny")
    one = {**tiny, "moe": {"num_experts": 1, "top_k": 1}}
    router = tiny["num_layers"] * tiny["hidden_size"]
    assert parameter_count(one) == llama_active_parameter_count(one) == parameter_count(tiny) + router


def test_every_second_block_and_shared_experts_count_their_parameters():
    tiny = preset("mixtral_tiny")
    h, f, layers = tiny["hidden_size"], tiny["ffn_hidden_size"], tiny["num_layers"]
    dense = parameter_count({**tiny, "moe": None})
    cfg = {**tiny, "moe": {**tiny["moe"], "every": 2, "expert_ffn_hidden_size": 16, "shared_experts": 2,
                           "shared_expert_ffn_hidden_size": 8, "shared_expert_gate": True}}
    assert [moe_config(cfg).is_moe_block(b) for b in range(layers)] == [False, True, False, True]
    per_moe = 4 * 3 * h * 16 + 3 * h * 16 + h * 4 + h   # experts, shared (2 x 8 wide), router, gate
    per_active = 2 * 3 * h * 16 + 3 * h * 16 + h * 4 + h
    assert parameter_count(cfg) == dense + 2 * (per_moe - 3 * h * f)
    assert llama_active_parameter_count(cfg) == dense + 2 * (per_active - 3 * h * f)


def test_flops_count_the_active_mlp():
    cfg = preset("mixtral_8x7b")
    dense = {**cfg, "moe": None, "ffn_hidden_size": 2 * cfg["ffn_hidden_size"]}   # two experts' GEMMs
    router = 2 * cfg["seq_len"] * cfg["hidden_size"] * 8 * cfg["num_layers"] * 3   # forward and backward
    assert flops_per_sample(cfg, recompute=False) == pytest.approx(flops_per_sample(dense, False) + router, rel=1e-12)


def test_the_planner_reads_each_moe_blocks_experts_and_all_to_all_bytes():
    cfg = preset("qwen2_moe_a2.7b")
    blocks = moe_block_facts(cfg, dtype_bytes=2)
    assert [b.block for b in blocks] == list(range(24))
    assert blocks[0].expert_parameters == 60 * 3 * 2048 * 1408
    assert blocks[0].shared_parameters == 3 * 2048 * 5632 + 2048 * 60 + 2048
    assert blocks[0].dispatch_bytes_per_token == blocks[0].combine_bytes_per_token == 4 * 2048 * 2
    every2 = {**cfg, "moe": {**cfg["moe"], "every": 2}}
    assert [b.block for b in moe_block_facts(every2, 2)] == list(range(1, 24, 2))
    assert moe_block_facts(preset("llama3_8b"), 2) == []


def test_capacity_is_a_ceiling_per_expert():
    cfg = {**preset("mixtral_tiny")}
    cfg["moe"] = {**cfg["moe"], "capacity_factor": 1.0}
    assert moe_config(cfg).capacity(tokens=5) == 3   # ceil(1.0 * 5 * 2 / 4)
    assert moe_config(preset("mixtral_tiny")).capacity(tokens=5) is None


BAD = [({"top_k": 5}, r"^model.moe.top_k=5 exceeds model.moe.num_experts=4: .*top_k <= 4$"),
       ({"top_k": 0}, r"^model.moe.top_k=0 must be an integer >= 1"),
       ({"num_experts": -1}, r"^model.moe.num_experts=-1 must be an integer >= 0"),
       ({"every": 5}, r"^model.moe.every=5 exceeds model.num_layers=4"),
       ({"shared_expert_gate": True}, r"^model.moe.shared_expert_gate=true without shared experts"),
       ({"capacity_factor": 0}, r"^model.moe.capacity_factor=0 must be a number > 0"),
       ({"aux_loss_coef": -0.1}, r"^model.moe.aux_loss_coef=-0.1 must be a number >= 0"),
       ({"expert_ffn_hidden_size": 0}, r"^model.moe.expert_ffn_hidden_size=0 must be a positive integer or null"),
       ({"renormalize": "yes"}, r"^model.moe.renormalize='yes' must be true or false"),
       ({"experts": 4}, r"^model.moe has unknown keys experts: the keys are num_experts, ")]


@pytest.mark.parametrize("change,message", BAD)
def test_a_broken_moe_rule_is_one_line(change, message):
    cfg = preset("mixtral_tiny")
    cfg["moe"] = {**cfg["moe"], **change}
    with pytest.raises(ConfigError, match=message) as error:
        check_llama_config(cfg, 1)
    assert "\n" not in str(error.value)


def test_moe_refuses_tensor_parallelism_in_one_line():
    with pytest.raises(ConfigError, match=r"^model.moe has no tensor-parallel form but parallel.tp=2") as error:
        check_llama_tensor_parallel(preset("mixtral_tiny"), 2)
    assert "\n" not in str(error.value)


def test_the_presets_spell_every_key():
    for name in ("mixtral_tiny", *PUBLISHED):
        assert set(preset(name)["moe"]) == set(MOE_DEFAULTS)


def _transformers_count(name: str) -> int:
    """The parameters of the same architecture as transformers builds it (on the meta device)."""
    transformers = pytest.importorskip("transformers")
    import torch

    cfg, moe = preset(name), preset(name)["moe"]
    common = dict(hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_layers"],
                  num_attention_heads=cfg["num_heads"], num_key_value_heads=cfg["num_kv_heads"],
                  vocab_size=cfg["vocab_size"], tie_word_embeddings=cfg["tie_embeddings"],
                  num_experts_per_tok=moe["top_k"])
    if name.startswith("mixtral"):
        config = transformers.MixtralConfig(intermediate_size=moe["expert_ffn_hidden_size"] or cfg["ffn_hidden_size"],
                                            num_local_experts=moe["num_experts"], **common)
        build = transformers.MixtralForCausalLM
    else:
        config = transformers.Qwen2MoeConfig(intermediate_size=cfg["ffn_hidden_size"], num_experts=moe["num_experts"],
                                             moe_intermediate_size=moe["expert_ffn_hidden_size"],
                                             shared_expert_intermediate_size=moe["shared_expert_ffn_hidden_size"],
                                             decoder_sparse_step=moe["every"], **common)
        build = transformers.Qwen2MoeForCausalLM
    with torch.device("meta"):
        return sum(p.numel() for p in build(config).parameters())


@pytest.mark.parametrize("name", PUBLISHED)
def test_moe_preset_counts_are_transformers_own(name):
    """The published figures are rounded to 2 or 3 digits; the architecture's exact count is what
    transformers builds from the same sizes (Qwen2-MoE's q/k/v biases, which the preset leaves out,
    added)."""
    cfg = preset(name)
    biases = cfg["num_layers"] * (cfg["hidden_size"] + 2 * cfg["num_kv_heads"] * cfg["hidden_size"] // cfg["num_heads"])
    expected = _transformers_count(name) - (biases if name.startswith("qwen") else 0)
    assert parameter_count(cfg) == expected
