"""Hugging Face mixture-of-experts decoders (``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``) under
``model=hf``, described without torch: their MoE settings as a ``MoEConfig``, which decoder layers
are MoE, what ``model=hf`` refuses, and where an MoE layer's tensors live in the checkpoint.

The checkpoint keeps one tensor per expert and projection, as ``save_pretrained`` writes them
(Mixtral: ``block_sparse_moe.experts.E.w1/w3/w2``, Qwen2-MoE: ``mlp.experts.E.gate_proj/up_proj/
down_proj``); ``models.families.moe``'s experts hold gate and up as one fused matrix ([gate; up]),
so a local expert tensor is read from (and written back to) two stored ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from models.errors import ConfigError
from models.families.moe_facts import MoEConfig


@dataclass(frozen=True)
class MoECheckpointNames:
    """An architecture's names under ``model.layers.N``: the MoE block, its router, one expert's
    gate / up / down projections, and the shared expert (Qwen2-MoE) with its sigmoid gate."""

    block: str
    router: str
    gate: str
    up: str
    down: str
    shared: str | None = None
    shared_gate: str | None = None


MOE_NAMES = MappingProxyType({
    "mixtral": MoECheckpointNames("block_sparse_moe", "gate", "w1", "w3", "w2"),
    "qwen2_moe": MoECheckpointNames("mlp", "gate", "gate_proj", "up_proj", "down_proj",
                                    shared="shared_expert", shared_gate="shared_expert_gate"),
})
MIXTRAL_ARCHITECTURE = "MixtralForCausalLM"


def _positive(hf_config: Mapping[str, Any], key: str) -> int:
    value = hf_config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"config.json has {key}={value!r}: model=hf needs a positive integer there (give the "
                          f"config save_pretrained wrote)")
    return value


def hf_moe_config(hf_config: Mapping[str, Any]) -> MoEConfig | None:
    """The MoE settings of a Mixtral or Qwen2-MoE config.json (None for any other model), checked:
    what model=hf cannot reproduce is one ConfigError line naming the key, its value and a fix.
    The load-balancing coefficient is ``router_aux_loss_coef``: training adds it to the loss as
    transformers does with ``output_router_logits=True`` (set it to 0 in config.json to train
    without it). There is no z-loss and no capacity: routing is dropless, as in transformers."""
    model_type = hf_config.get("model_type")
    if model_type not in MOE_NAMES:
        return None
    experts_key = "num_local_experts" if model_type == "mixtral" else "num_experts"
    num_experts, top_k = _positive(hf_config, experts_key), _positive(hf_config, "num_experts_per_tok")
    if top_k > num_experts:
        raise ConfigError(f"config.json has num_experts_per_tok={top_k} > {experts_key}={num_experts}: a token "
                          f"picks that many of the experts; lower num_experts_per_tok")
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json has hidden_act={hf_config.get('hidden_act')!r}: model=hf's MoE experts are "
                          f"SwiGLU (silu); set hidden_act to silu or use transformers directly")
    coef = hf_config.get("router_aux_loss_coef", 0.0)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
        raise ConfigError(f"config.json has router_aux_loss_coef={coef!r}: give a number >= 0")
    if model_type == "mixtral":
        jitter = hf_config.get("router_jitter_noise") or 0.0
        if jitter:
            raise ConfigError(f"config.json has router_jitter_noise={jitter}: model=hf routes without jitter; set "
                              f"router_jitter_noise to 0.0 in config.json")
        return MoEConfig(num_experts=num_experts, top_k=top_k, expert_ffn=_positive(hf_config, "intermediate_size"),
                         shared_experts=0, shared_ffn=0, shared_expert_gate=False, renormalize=True, every=1,
                         aux_loss_coef=float(coef), z_loss_coef=0.0, capacity_factor=None)
    return MoEConfig(num_experts=num_experts, top_k=top_k, expert_ffn=_positive(hf_config, "moe_intermediate_size"),
                     shared_experts=1, shared_ffn=_positive(hf_config, "shared_expert_intermediate_size"),
                     shared_expert_gate=True, renormalize=bool(hf_config.get("norm_topk_prob", False)),
                     every=_positive(hf_config, "decoder_sparse_step"), aux_loss_coef=float(coef), z_loss_coef=0.0,
                     capacity_factor=None)


def is_moe_layer(hf_config: Mapping[str, Any], moe: MoEConfig, index: int) -> bool:
    """Whether decoder layer ``index`` (from 0) is MoE: every layer of a Mixtral; a Qwen2-MoE layer
    when (index + 1) % decoder_sparse_step == 0 and it is not in ``mlp_only_layers``."""
    if hf_config.get("model_type") == "mixtral":
        return True
    return moe.is_moe_block(index) and index not in (hf_config.get("mlp_only_layers") or [])


def moe_layer_count(hf_config: Mapping[str, Any], moe: MoEConfig, num_layers: int) -> int:
    return sum(is_moe_layer(hf_config, moe, index) for index in range(num_layers))


def moe_layer_keys(hf_config: Mapping[str, Any], moe: MoEConfig, prefix: str, stored: Mapping[str, str],
                   experts: range) -> dict[str, tuple[str, ...]]:
    """An MoE decoder layer's tensors (``prefix`` = ``model.layers.N``): its local name in the
    pipeline layer -> the stored tensors it is made of (two, stacked by rows, for a fused [gate; up]).
    ``experts``: the global indices of the experts this rank holds (all without expert parallelism)."""
    names = MOE_NAMES[hf_config["model_type"]]
    block = f"{prefix}.{names.block}"
    keys = {f"layer.{name[len(prefix) + 1:]}": (name,) for name in stored
            if name.startswith(prefix + ".") and not name.startswith(block + ".")}
    keys["layer.mlp.router.weight"] = (f"{block}.{names.router}.weight",)
    for e in experts:
        stored_expert = f"{block}.experts.{e}"
        keys[f"layer.mlp.experts.{e}.gate_up_proj.weight"] = (f"{stored_expert}.{names.gate}.weight",
                                                              f"{stored_expert}.{names.up}.weight")
        keys[f"layer.mlp.experts.{e}.down_proj.weight"] = (f"{stored_expert}.{names.down}.weight",)
    if names.shared is not None and moe.shared_experts:
        shared = f"{block}.{names.shared}"
        keys["layer.mlp.shared.gate_up_proj.weight"] = (f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight")
        keys["layer.mlp.shared.down_proj.weight"] = (f"{shared}.down_proj.weight",)
        keys["layer.mlp.shared_gate.weight"] = (f"{block}.{names.shared_gate}.weight",)
    missing = sorted(name for group in keys.values() for name in group if name not in stored)
    if missing:
        raise ConfigError(f"the checkpoint lacks {missing[0]} (and {len(missing) - 1} more): save the model with "
                          f"save_pretrained, one tensor per expert and projection")
    return keys


def mixtral_config(model_cfg: Mapping[str, Any], moe: MoEConfig, dense_config: dict[str, Any]) -> dict[str, Any]:
    """The ``MixtralConfig`` (as a config.json dict) of an MoE ``model=llama`` config whose dense
    part is ``dense_config`` (``llama_hf.hf_config``); one ConfigError line for an MoE form Mixtral
    cannot hold. Mixtral's load-balancing loss is computed over all layers' routing at once, the
    llama family's as the mean of per-layer losses: ``router_aux_loss_coef`` carries the coefficient."""
    rules = [("shared_experts", moe.shared_experts, 0), ("renormalize", moe.renormalize, True),
             ("every", moe.every, 1)]
    for key, value, needed in rules:
        if value != needed:
            raise ConfigError(f"model.moe.{key}={value!r}: the Hugging Face export writes Mixtral "
                              f"(MixtralForCausalLM), which needs model.moe.{key}={needed!r}; export with format=torch")
    if moe.capacity_factor is not None:
        raise ConfigError(f"model.moe.capacity_factor={moe.capacity_factor}: Mixtral routes without a capacity, so its "
                          f"logits would differ; export with format=torch")
    config = {key: value for key, value in dense_config.items() if key not in ("mlp_bias", "rope_scaling")}
    if dense_config.get("rope_scaling") is not None:
        raise ConfigError("model.rope_scaling is set: Mixtral has no Llama 3 frequency scaling; export with "
                          "format=torch")
    return config | {"architectures": [MIXTRAL_ARCHITECTURE], "model_type": "mixtral",
                     "intermediate_size": moe.expert_ffn, "num_local_experts": moe.num_experts,
                     "num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.aux_loss_coef,
                     "router_jitter_noise": 0.0, "output_router_logits": False, "sliding_window": None}
