"""Mixture-of-experts MLPs in the Llama family, described without torch: the ``model.moe`` keys,
their rules, which blocks hold an MoE MLP, and the parameters, FLOPs and all-to-all bytes of
those blocks. ``models.families.llama_facts`` counts with these; ``models.families.moe`` builds
the layers; the planner reads ``moe_block_facts``.

An MoE MLP: a router (Linear hidden -> num_experts, no bias), ``num_experts`` SwiGLU experts of
width ``expert_ffn_hidden_size`` of which each token goes through ``top_k``, and optionally
``shared_experts`` that every token goes through, together one SwiGLU of ``shared_experts x
shared_expert_ffn_hidden_size``, scaled by sigmoid(Linear(hidden, 1)(x)) with
``shared_expert_gate`` (Qwen2-MoE).

Blocks: with ``every`` = k the MoE MLP replaces the dense one in blocks k-1, 2k-1, ... (block
indices from 0): every block for k = 1, the odd blocks for k = 2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from models.errors import ConfigError

# The keys of ``model.moe`` and what leaving one out means; num_experts = 0 (or no ``moe``) is dense.
MOE_DEFAULTS = MappingProxyType({
    "num_experts": 0, "top_k": 2, "expert_ffn_hidden_size": None, "shared_experts": 0,
    "shared_expert_ffn_hidden_size": None, "shared_expert_gate": False, "renormalize": True, "every": 1,
    "aux_loss_coef": 0.01, "z_loss_coef": 0.0, "capacity_factor": None})


@dataclass(frozen=True)
class MoEConfig:
    """``model.moe`` with its defaults filled in and the widths resolved (``moe_config``)."""

    num_experts: int
    top_k: int
    expert_ffn: int             # one routed expert's SwiGLU width
    shared_experts: int
    shared_ffn: int             # one shared expert's width (they form one SwiGLU of shared_experts x this)
    shared_expert_gate: bool
    renormalize: bool
    every: int
    aux_loss_coef: float
    z_loss_coef: float
    capacity_factor: float | None

    def is_moe_block(self, block: int) -> bool:
        """Whether block ``block`` (from 0) holds the MoE MLP: blocks every-1, 2*every-1, ..."""
        return (block + 1) % self.every == 0

    def moe_blocks(self, num_layers: int) -> int:
        return num_layers // self.every

    def capacity(self, tokens: int) -> int | None:
        """Token-slots one expert takes out of ``tokens`` x top_k; None when dropless."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)


def _integer(moe: Mapping[str, Any], key: str, minimum: int) -> int:
    value = moe.get(key, MOE_DEFAULTS[key])
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"model.moe.{key}={value!r} must be an integer >= {minimum}: set model.moe.{key} "
                          f"to one (default {MOE_DEFAULTS[key]})")
    return value


def _width(moe: Mapping[str, Any], key: str, fallback: int) -> int:
    value = moe.get(key, MOE_DEFAULTS[key])
    if value is None:
        return fallback
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"model.moe.{key}={value!r} must be a positive integer or null: set a width, or null "
                          f"for the default")
    return value


def _number(moe: Mapping[str, Any], key: str, positive: bool = False) -> float:
    value = moe.get(key, MOE_DEFAULTS[key])
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (positive and value == 0):
        rule = "a number > 0" if positive else "a number >= 0"
        raise ConfigError(f"model.moe.{key}={value!r} must be {rule}: set model.moe.{key} accordingly")
    return float(value)


def _flag(moe: Mapping[str, Any], key: str) -> bool:
    value = moe.get(key, MOE_DEFAULTS[key])
    if not isinstance(value, bool):
        raise ConfigError(f"model.moe.{key}={value!r} must be true or false")
    return value


def moe_config(model_cfg: Mapping[str, Any]) -> MoEConfig | None:
    """The checked ``model.moe`` of a llama config, None when dense (no ``moe`` or num_experts = 0).
    Each broken rule is one ConfigError line naming the value, the rule and a fix."""
    moe = model_cfg.get("moe")
    if moe is None:
        return None
    if not hasattr(moe, "get") or not hasattr(moe, "keys"):
        raise ConfigError(f"model.moe={moe!r} must be a mapping of MoE keys ({', '.join(MOE_DEFAULTS)}) or absent")
    unknown = sorted(str(key) for key in moe.keys() if key not in MOE_DEFAULTS)
    if unknown:
        raise ConfigError(f"model.moe has unknown keys {', '.join(unknown)}: the keys are {', '.join(MOE_DEFAULTS)}")
    experts = _integer(moe, "num_experts", 0)
    if experts == 0:
        return None
    top_k = _integer(moe, "top_k", 1)
    if top_k > experts:
        raise ConfigError(f"model.moe.top_k={top_k} exceeds model.moe.num_experts={experts}: a token picks top_k of "
                          f"the experts, so set top_k <= {experts}")
    expert_ffn = _width(moe, "expert_ffn_hidden_size", int(model_cfg["ffn_hidden_size"]))
    shared = _integer(moe, "shared_experts", 0)
    gate = _flag(moe, "shared_expert_gate")
    if gate and shared == 0:
        raise ConfigError("model.moe.shared_expert_gate=true without shared experts: set model.moe.shared_experts "
                          ">= 1 or shared_expert_gate=false")
    every = _integer(moe, "every", 1)
    layers = int(model_cfg["num_layers"])
    if every > layers:
        raise ConfigError(f"model.moe.every={every} exceeds model.num_layers={layers}, so no block would be MoE: "
                          f"set every <= {layers} (or num_experts=0 for a dense model)")
    capacity = moe.get("capacity_factor", MOE_DEFAULTS["capacity_factor"])
    return MoEConfig(num_experts=experts, top_k=top_k, expert_ffn=expert_ffn, shared_experts=shared,
                     shared_ffn=_width(moe, "shared_expert_ffn_hidden_size", expert_ffn), shared_expert_gate=gate,
                     renormalize=_flag(moe, "renormalize"), every=every,
                     aux_loss_coef=_number(moe, "aux_loss_coef"), z_loss_coef=_number(moe, "z_loss_coef"),
                     capacity_factor=None if capacity is None else _number(moe, "capacity_factor", positive=True))


def swiglu_parameters(hidden: int, ffn: int) -> int:
    """gate, up and down: 3 h f."""
    return 3 * hidden * ffn


def router_parameters(hidden: int, moe: MoEConfig) -> int:
    """The router's h x E matrix and, with a shared-expert gate, its h x 1 matrix."""
    return hidden * moe.num_experts + (hidden if moe.shared_expert_gate else 0)


def shared_parameters(hidden: int, moe: MoEConfig) -> int:
    return swiglu_parameters(hidden, moe.shared_experts * moe.shared_ffn)


def moe_mlp_parameters(hidden: int, moe: MoEConfig) -> int:
    """All of an MoE MLP's parameters: every routed expert, the shared experts, the router (and gate)."""
    return moe.num_experts * swiglu_parameters(hidden, moe.expert_ffn) + shared_parameters(hidden, moe) \
        + router_parameters(hidden, moe)


def moe_mlp_active_parameters(hidden: int, moe: MoEConfig) -> int:
    """What one token goes through: top_k routed experts, the shared experts, the router (and gate)."""
    return moe.top_k * swiglu_parameters(hidden, moe.expert_ffn) + shared_parameters(hidden, moe) \
        + router_parameters(hidden, moe)


def moe_mlp_forward_flops(seq_len: int, hidden: int, moe: MoEConfig) -> float:
    """One MoE MLP's forward per sequence, 2 FLOPs per multiply-add of the GEMMs a token goes
    through (its top_k experts, the shared experts, the router and gate); the softmax, top-k and
    the weighted sum are left out, as SwiGLU's elementwise work is."""
    return float(2 * seq_len * moe_mlp_active_parameters(hidden, moe))


@dataclass(frozen=True)
class MoEBlockFacts:
    """What the planner needs of one MoE block (``moe_block_facts``)."""

    block: int                       # block index from 0 (pipeline layer block + 1)
    expert_parameters: int           # all routed experts (what expert parallelism splits)
    shared_parameters: int           # shared experts and router (and gate): replicated
    dispatch_bytes_per_token: int    # hidden bytes one token sends to its experts (top_k copies)
    combine_bytes_per_token: int     # and receives back


def moe_block_facts(model_cfg: Mapping[str, Any], dtype_bytes: int) -> list[MoEBlockFacts]:
    """Per MoE block of a llama config: its routed experts' parameters (all of them) and the bytes
    an all-to-all dispatch and combine move per token (top_k x hidden x ``dtype_bytes`` each way,
    dropless); an empty list when the model is dense."""
    moe = moe_config(model_cfg)
    if moe is None:
        return []
    hidden = int(model_cfg["hidden_size"])
    routed = moe.num_experts * swiglu_parameters(hidden, moe.expert_ffn)
    moved = moe.top_k * hidden * int(dtype_bytes)
    return [MoEBlockFacts(block, routed, shared_parameters(hidden, moe) + router_parameters(hidden, moe), moved, moved)
            for block in range(int(model_cfg["num_layers"])) if moe.is_moe_block(block)]
