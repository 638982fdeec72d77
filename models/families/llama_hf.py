"""Llama weights in Hugging Face ``transformers`` form (``LlamaForCausalLM``; an MoE model as
``MixtralForCausalLM``) and back (dense).

The single-process state dict names parameters ``<layer index>.<name>`` (``pipedream.export``'s
consolidated checkpoint): layer 0 the embedding, 1..L the blocks, L+1 the head. The computation
is the same (``models.families.llama``), so the mapping renames tensors and splits or joins the
fused [gate; up] projection; nothing is transposed or permuted. A tied head is left out of the
Hugging Face state, as its own checkpoints leave out ``lm_head.weight``.

Torch-free at import: ``to_hf`` only slices tensors; ``from_hf`` imports torch to join them.
"""
from __future__ import annotations

from typing import Any, Mapping

from models.errors import ConfigError
from models.families.hf_moe_facts import mixtral_config
from models.families.moe_facts import moe_config
from models.families.llama_facts import REQUIRED_KEYS, llama_option, rope_scaling

HF_ARCHITECTURE = "LlamaForCausalLM"
# block parameter -> the Hugging Face name under model.layers.N (the fused gate/up is handled apart)
BLOCK_NAMES = {f"self_attn.{p}.weight": f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
BLOCK_NAMES |= {"input_layernorm.weight": "input_layernorm.weight",
                "post_attention_layernorm.weight": "post_attention_layernorm.weight",
                "mlp.down_proj.weight": "mlp.down_proj.weight"}
GATE_UP = "mlp.gate_up_proj.weight"


def hf_config(model_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The ``transformers.LlamaConfig`` of a ``model=llama`` config, as a config.json dict."""
    hidden, heads = int(model_cfg["hidden_size"]), int(model_cfg["num_heads"])
    scaling = rope_scaling(model_cfg)
    return {
        "architectures": [HF_ARCHITECTURE], "model_type": "llama",
        "vocab_size": int(model_cfg["vocab_size"]), "hidden_size": hidden,
        "intermediate_size": int(model_cfg["ffn_hidden_size"]), "num_hidden_layers": int(model_cfg["num_layers"]),
        "num_attention_heads": heads, "num_key_value_heads": int(model_cfg["num_kv_heads"]),
        "head_dim": hidden // heads, "hidden_act": "silu", "max_position_embeddings": int(model_cfg["seq_len"]),
        "rms_norm_eps": float(llama_option(model_cfg, "norm_eps")),
        "rope_theta": float(llama_option(model_cfg, "rope_theta")),
        "rope_scaling": None if scaling is None else {"rope_type": "llama3", **scaling},
        "tie_word_embeddings": bool(llama_option(model_cfg, "tie_embeddings")),
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "initializer_range": 0.02,
    }


def to_hf(model_state: Mapping[str, Any], model_cfg: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config_dict, hf_state) for a consolidated single-process state dict: a dense model as
    ``LlamaForCausalLM``, an MoE one as ``MixtralForCausalLM`` (an MoE form Mixtral cannot hold is
    refused in one line, ``hf_moe_facts.mixtral_config``)."""
    moe = moe_config(model_cfg)
    config = hf_config(model_cfg) if moe is None else mixtral_config(model_cfg, moe, hf_config(model_cfg))
    layers = config["num_hidden_layers"]
    head = layers + 1
    hf_state = {"model.embed_tokens.weight": _get(model_state, "0.embed_tokens.weight"),
                "model.norm.weight": _get(model_state, f"{head}.norm.weight")}
    if not config["tie_word_embeddings"]:
        hf_state["lm_head.weight"] = _get(model_state, f"{head}.weight")
    for block in range(layers):
        prefix, hf_prefix = f"{block + 1}.", f"model.layers.{block}."
        if moe is not None:
            hf_state.update(_mixtral_block(model_state, prefix, hf_prefix, moe.num_experts))
            continue
        for name, hf_name in BLOCK_NAMES.items():
            hf_state[hf_prefix + hf_name] = _get(model_state, prefix + name)
        gate, up = _get(model_state, prefix + GATE_UP).chunk(2, dim=0)
        hf_state[hf_prefix + "mlp.gate_proj.weight"] = gate.contiguous()
        hf_state[hf_prefix + "mlp.up_proj.weight"] = up.contiguous()
    return config, hf_state


def _mixtral_block(model_state: Mapping[str, Any], prefix: str, hf_prefix: str, num_experts: int) -> dict[str, Any]:
    """An MoE block under Mixtral's names: the router is ``block_sparse_moe.gate``, expert E's fused
    [gate; up] its ``w1`` and ``w3``, its down projection ``w2``."""
    block = {hf_name: _get(model_state, prefix + name) for name, hf_name in BLOCK_NAMES.items()
             if not name.startswith("mlp.")}
    moe_prefix = "block_sparse_moe."
    block[moe_prefix + "gate.weight"] = _get(model_state, prefix + "mlp.router.weight")
    for e in range(num_experts):
        expert, hf_expert = f"{prefix}mlp.experts.{e}.", f"{moe_prefix}experts.{e}."
        w1, w3 = _get(model_state, expert + "gate_up_proj.weight").chunk(2, dim=0)
        block |= {hf_expert + "w1.weight": w1.contiguous(), hf_expert + "w3.weight": w3.contiguous(),
                  hf_expert + "w2.weight": _get(model_state, expert + "down_proj.weight")}
    return {hf_prefix + name: tensor for name, tensor in block.items()}


def from_hf(hf_state: Mapping[str, Any], hf_config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model config dict, single-process state dict) from a ``LlamaForCausalLM`` state dict and
    its config (a ``LlamaConfig`` or its dict)."""
    get = hf_config.get if isinstance(hf_config, Mapping) else lambda key, default=None: getattr(hf_config, key, default)
    hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    head_dim = get("head_dim")
    if head_dim not in (None, hidden // heads):
        raise ConfigError(f"head_dim={head_dim} differs from hidden_size / num_attention_heads = {hidden // heads}: "
                          f"model=llama derives the head size from them")
    if get("attention_bias") or get("mlp_bias"):
        raise ConfigError("attention_bias / mlp_bias is set: model=llama has no biases")
    rope = dict(get("rope_parameters") or get("rope_scaling") or {})
    theta = rope.get("rope_theta", get("rope_theta"))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ConfigError(f"rope_type={kind!r} is not supported: model=llama implements 'default' and 'llama3'")
    scaling = ({key: rope[key] for key in ("factor", "low_freq_factor", "high_freq_factor",
                                           "original_max_position_embeddings")} if kind == "llama3" else None)
    tied = bool(get("tie_word_embeddings", False))
    model_cfg = {"name": "llama", "num_layers": int(get("num_hidden_layers")), "hidden_size": hidden,
                 "num_heads": heads, "num_kv_heads": int(get("num_key_value_heads") or heads),
                 "ffn_hidden_size": int(get("intermediate_size")), "seq_len": int(get("max_position_embeddings")),
                 "vocab_size": int(get("vocab_size")), "tie_embeddings": tied,
                 "norm_eps": float(get("rms_norm_eps")), "rope_theta": float(theta if theta is not None else 10000.0),
                 "rope_scaling": scaling}
    layers, head = model_cfg["num_layers"], model_cfg["num_layers"] + 1
    state = {"0.embed_tokens.weight": _get(hf_state, "model.embed_tokens.weight"),
             f"{head}.norm.weight": _get(hf_state, "model.norm.weight"),
             f"{head}.weight": _get(hf_state, "model.embed_tokens.weight" if tied else "lm_head.weight")}
    for block in range(layers):
        prefix, hf_prefix = f"{block + 1}.", f"model.layers.{block}."
        for name, hf_name in BLOCK_NAMES.items():
            state[prefix + name] = _get(hf_state, hf_prefix + hf_name)
        gate, up = _get(hf_state, hf_prefix + "mlp.gate_proj.weight"), _get(hf_state, hf_prefix + "mlp.up_proj.weight")
        state[prefix + GATE_UP] = _concat_rows(gate, up)
    return model_cfg, state


def _concat_rows(first: Any, second: Any) -> Any:
    import torch   # only here: joining tensors needs torch's cat

    return torch.cat((first, second), dim=0)


def _get(state: Mapping[str, Any], key: str) -> Any:
    if key not in state:
        raise ConfigError(f"the state dict has no {key!r}: it is not a model=llama state dict with these sizes "
                          f"(keys needed: {', '.join(REQUIRED_KEYS)} as configured)")
    return state[key]
