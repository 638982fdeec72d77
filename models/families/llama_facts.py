"""Llama described without torch: its keys and their defaults, pipeline layers, parameters, FLOPs
and configuration rules, including how grouped-query attention splits over tensor-parallel ranks.
Mixture-of-experts MLPs (``model.moe``) are counted through ``models.families.moe_facts``.
``models.families.llama`` builds what these describe; ``models.registry`` declares the family.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

from models.errors import ConfigError
from models.families.moe_facts import MoEConfig, moe_config, moe_mlp_active_parameters, moe_mlp_forward_flops, \
    moe_mlp_parameters, swiglu_parameters
from models.families.transformer_facts import transformer_pipeline_layers

REQUIRED_KEYS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "seq_len",
                 "vocab_size")
# The keys a llama config may leave out, and what leaving one out means (read through ``llama_option``).
OPTIONAL_KEYS = MappingProxyType({"tie_embeddings": False, "norm_eps": 1e-5, "rope_theta": 500000.0,
                                  "rope_scaling": None})
ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def llama_option(model_cfg: Mapping[str, Any], key: str) -> Any:
    """``model_cfg[key]``, or its meaning when left out (``OPTIONAL_KEYS``)."""
    return model_cfg.get(key, OPTIONAL_KEYS[key])


def rope_scaling(model_cfg: Mapping[str, Any]) -> dict[str, float] | None:
    """Llama 3's frequency scaling as plain numbers, None when the config has none."""
    scaling = llama_option(model_cfg, "rope_scaling")
    if scaling is None:
        return None
    return {key: float(scaling[key]) for key in ROPE_SCALING_KEYS}


def llama_layer_count(model_cfg: Mapping[str, Any]) -> int:
    return transformer_pipeline_layers(int(model_cfg["num_layers"]))


def _sizes(model_cfg: Mapping[str, Any]) -> tuple[int, int, int, int, int, int]:
    """(layers, hidden, key/value width, ffn, vocabulary, context) of a config."""
    h, heads, kv = int(model_cfg["hidden_size"]), int(model_cfg["num_heads"]), int(model_cfg["num_kv_heads"])
    return (int(model_cfg["num_layers"]), h, kv * (h // heads), int(model_cfg["ffn_hidden_size"]),
            int(model_cfg["vocab_size"]), int(model_cfg["seq_len"]))


def llama_block_parameters(hidden: int, kv_width: int, ffn: int) -> int:
    """Q and O (h x h), K and V (h x kv_width), gate, up and down (3 h f), two RMSNorm weights."""
    return _attention_and_norms(hidden, kv_width) + swiglu_parameters(hidden, ffn)


def _attention_and_norms(hidden: int, kv_width: int) -> int:
    return 2 * hidden * hidden + 2 * hidden * kv_width + 2 * hidden


def _mlp_parameters(model_cfg: Mapping[str, Any], active: bool) -> int:
    """All blocks' MLPs: dense SwiGLUs and MoE MLPs (all experts, or what one token goes through)."""
    layers, h, _, ffn, _, _ = _sizes(model_cfg)
    moe = moe_config(model_cfg)
    if moe is None:
        return layers * swiglu_parameters(h, ffn)
    sparse = moe.moe_blocks(layers)
    per_moe = moe_mlp_active_parameters(h, moe) if active else moe_mlp_parameters(h, moe)
    return sparse * per_moe + (layers - sparse) * swiglu_parameters(h, ffn)


def _parameters(model_cfg: Mapping[str, Any], active: bool) -> int:
    layers, h, kv_width, _, vocab, _ = _sizes(model_cfg)
    head = 0 if bool(llama_option(model_cfg, "tie_embeddings")) else vocab * h
    return layers * _attention_and_norms(h, kv_width) + _mlp_parameters(model_cfg, active) + vocab * h + h + head


def llama_parameter_count(model_cfg: Mapping[str, Any]) -> int:
    """Parameters of the ``models.families.llama`` model: blocks (with MoE, every expert of every
    MoE block), the token embedding, the final RMSNorm and, untied, the output head's own V x h
    matrix (no biases, no positions)."""
    return _parameters(model_cfg, active=False)


def llama_active_parameter_count(model_cfg: Mapping[str, Any]) -> int:
    """Parameters one token goes through, counted as Mixtral's 12.9B and Qwen1.5-MoE's 2.7B are:
    attention and RMSNorms, in an MoE block the router (and shared-expert gate), the shared
    experts and top_k routed experts, and the token embedding, final RMSNorm and output head (the
    embedding table counts whole though a token reads one row). Dense models: the total."""
    return _parameters(model_cfg, active=True)


def llama_block_forward_flops(seq_len: int, hidden: int, kv_width: int, ffn: int, moe: MoEConfig | None = None,
                              block: int = 0) -> float:
    """One block's forward per sequence, 2 FLOPs per multiply-add: the GEMMs (2 s x its weights)
    and attention's two s x s products over the full hidden width (4 s^2 h, as eq. 4.2 counts
    them, causal masking not subtracted). RMSNorm, RoPE and SwiGLU's elementwise work are left
    out, as eq. 4.2 leaves out LayerNorm and GELU. With ``moe`` and ``block`` an MoE block (from
    0), its MLP counts what each token goes through (``moe_facts.moe_mlp_forward_flops``)."""
    attention = 2 * seq_len * (2 * hidden * hidden + 2 * hidden * kv_width) + 4 * seq_len * seq_len * hidden
    if moe is not None and moe.is_moe_block(block):
        return float(attention + moe_mlp_forward_flops(seq_len, hidden, moe))
    return float(attention + 2 * seq_len * swiglu_parameters(hidden, ffn))


def llama_flops_per_iteration(model_cfg: Mapping[str, Any], batch: int, recompute: bool,
                              seq_len: int | None = None) -> float:
    """Eq. 4.2's accounting for GQA and SwiGLU: the blocks' forward, backward (2x) and, with
    recomputation, a second forward; the logit layer's 6 B s h V (never recomputed)."""
    layers, h, kv_width, ffn, vocab, context = _sizes(model_cfg)
    s = int(seq_len or context)
    passes = 4 if recompute else 3
    moe = moe_config(model_cfg)
    per_block = [llama_block_forward_flops(s, h, kv_width, ffn, moe, block) for block in range(layers)]
    return float(passes * batch * sum(per_block) + 6 * batch * s * h * vocab)


def check_llama_config(model_cfg: Mapping[str, Any], micro_batch: Any) -> None:
    """Heads split the hidden size evenly, key/value heads group the query heads evenly, RoPE
    needs an even head size, and a rope_scaling names all four of Llama 3's keys."""
    hidden, heads, kv = model_cfg["hidden_size"], model_cfg["num_heads"], model_cfg["num_kv_heads"]
    if hidden % heads:
        raise ConfigError(f"model.num_heads={heads} does not divide model.hidden_size={hidden}: "
                          f"choose heads among the divisors of {hidden}")
    if heads % kv:
        raise ConfigError(f"model.num_kv_heads={kv} does not divide model.num_heads={heads}: "
                          f"choose key/value heads among the divisors of {heads}")
    if (hidden // heads) % 2:
        raise ConfigError(f"model.hidden_size / model.num_heads = {hidden // heads} is odd: rotary embeddings "
                          f"rotate pairs of features, so choose an even head size")
    scaling = llama_option(model_cfg, "rope_scaling")
    if scaling is not None:
        missing = [key for key in ROPE_SCALING_KEYS if key not in scaling]
        if missing:
            raise ConfigError(f"model.rope_scaling lacks {', '.join(missing)}: give all of "
                              f"{', '.join(ROPE_SCALING_KEYS)}, or model.rope_scaling=null")
    moe_config(model_cfg)   # model.moe's rules


def kv_heads_per_rank(num_heads: int, num_kv_heads: int, tp: int) -> int:
    """Key/value heads each of ``tp`` ranks holds: its share when ``tp`` divides them, else one
    head replicated over ``tp / num_kv_heads`` ranks (whose query heads all read it); a
    one-line ConfigError for any other split."""
    if num_heads % tp:
        raise ConfigError(f"model.num_heads={num_heads} is not divisible by parallel.tp={tp}: "
                          f"choose parallel.tp dividing the number of attention heads")
    if num_kv_heads % tp == 0:
        return num_kv_heads // tp
    if tp % num_kv_heads == 0:
        return 1
    raise ConfigError(f"model.num_kv_heads={num_kv_heads} and parallel.tp={tp} neither divide the other: "
                      f"choose parallel.tp dividing {num_kv_heads} or a multiple of it")


def check_llama_tensor_parallel(model_cfg: Any, tp: int) -> None:
    """The family's tensor-parallel check (``models.registry``): heads (and so the hidden size)
    split over ``tp``, key/value heads split or replicate, the ffn splits; the vocabulary is
    padded to a multiple of t instead. Needs no process group. MoE models have no
    tensor-parallel form."""
    if moe_config(model_cfg) is not None:
        raise ConfigError(f"model.moe has no tensor-parallel form but parallel.tp={tp}: set parallel.tp=1 "
                          f"(or model.moe.num_experts=0 for a dense model)")
    hidden, heads = int(model_cfg["hidden_size"]), int(model_cfg["num_heads"])
    if hidden % heads:
        raise ConfigError(f"model.hidden_size={hidden} is not divisible by model.num_heads={heads}: "
                          f"choose a hidden size that is a multiple of the head count")
    kv_heads_per_rank(heads, int(model_cfg["num_kv_heads"]), tp)
    ffn = int(model_cfg["ffn_hidden_size"])
    if ffn % tp:
        raise ConfigError(f"model.ffn_hidden_size={ffn} is not divisible by parallel.tp={tp}: "
                          f"choose parallel.tp dividing the MLP's intermediate size")
