"""model=llama computes exactly what Hugging Face's LlamaForCausalLM computes: the state dict
mapped by ``to_hf`` loads strictly into it and the logits agree, tied and untied, with and without
Llama 3's RoPE scaling, with grouped-query attention; ``from_hf`` maps back. An MoE model
(mixtral_tiny) exports as MixtralForCausalLM with the same logits; MoE forms Mixtral cannot hold
are refused in one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from models import build_model
from models.families.llama_hf import from_hf, to_hf

transformers = pytest.importorskip("transformers")

TINY = yaml.safe_load((Path(__file__).resolve().parents[3] / "conf/model/llama_tiny.yaml").read_text())
SMALL = {**TINY, "num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 96,
         "seq_len": 32}
SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
CASES = {"untied": {}, "tied": {"tie_embeddings": True}, "rope_scaling": {"rope_scaling": SCALING, "rope_theta": 10.0},
         "mha_tied_scaled": {"num_kv_heads": 4, "tie_embeddings": True, "rope_scaling": SCALING}}


def _state(network: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in network.state_dict().items()}


@pytest.mark.parametrize("case", CASES)
def test_hugging_face_llama_computes_the_same_logits(case):
    cfg = {**SMALL, **CASES[case]}
    network = build_model(cfg, seed=3).build_sequential().eval()
    config, hf_state = to_hf(_state(network), cfg)
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    if cfg["tie_embeddings"]:   # its own checkpoints leave the tied head out too
        missing, unexpected = hf_model.load_state_dict(hf_state, strict=False)
        assert (missing, unexpected) == (["lm_head.weight"], [])
        assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    else:
        hf_model.load_state_dict(hf_state, strict=True)
    tokens = torch.randint(cfg["vocab_size"], (2, cfg["seq_len"]), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = network(tokens), hf_model(input_ids=tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_from_hf_inverts_to_hf():
    cfg = {**SMALL, "rope_scaling": SCALING}
    state = _state(build_model(cfg, seed=1).build_sequential())
    config, hf_state = to_hf(state, cfg)
    back_cfg, back_state = from_hf(hf_state, transformers.LlamaConfig(**config))
    assert back_cfg == cfg
    assert set(back_state) == set(state)
    for name, tensor in state.items():
        assert torch.equal(back_state[name], tensor), name


def test_the_registry_names_to_hf_as_the_family_export():
    from models.family import resolve
    from models.registry import model_family

    assert resolve(model_family("llama").hf_export) is to_hf


MIXTRAL = yaml.safe_load((Path(__file__).resolve().parents[3] / "conf/model/mixtral_tiny.yaml").read_text())


def test_an_moe_llama_exports_as_mixtral_with_the_same_logits(tmp_path):
    from safetensors.torch import save_file
    cfg = {**MIXTRAL, "seq_len": 16}
    network = build_model(cfg, seed=3).build_sequential().eval()
    with torch.no_grad():   # routers far from uniform, so a swapped expert or projection would show
        for name, param in network.named_parameters():
            if name.endswith("mlp.router.weight"):
                param.normal_(0.0, 1.0)
    config, hf_state = to_hf(_state(network), cfg)
    assert config["architectures"] == ["MixtralForCausalLM"] and config["router_aux_loss_coef"] == 0.01
    # one tensor per expert and projection, as save_pretrained writes them and from_pretrained reads them
    save_file(dict(hf_state), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf_model = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path), local_files_only=True).eval()
    tokens = torch.randint(cfg["vocab_size"], (2, cfg["seq_len"]), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = network(tokens), hf_model(input_ids=tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("moe, match", [({"shared_experts": 1}, r"model.moe.shared_experts=1: .*Mixtral"),
                                        ({"renormalize": False}, r"model.moe.renormalize=False"),
                                        ({"every": 2}, r"model.moe.every=2"),
                                        ({"capacity_factor": 1.0}, r"capacity_factor=1.0: Mixtral routes without")])
def test_moe_forms_mixtral_cannot_hold_are_refused(moe, match):
    from models.errors import ConfigError
    cfg = {**MIXTRAL, "moe": {**MIXTRAL["moe"], **moe}}
    with pytest.raises(ConfigError, match=match):
        to_hf({}, cfg)
