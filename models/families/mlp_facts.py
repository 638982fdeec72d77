"""The residual MLP (``models.families.mlp``) described without torch: ``num_layers`` blocks of two h x h
Linear layers, its parameters and FLOPs (``models.registry`` declares the family with them)."""
from __future__ import annotations

from typing import Any, Mapping

from models.families.formulas import mlp_flops_per_iteration

REQUIRED_KEYS = ("num_layers", "hidden_size")


def mlp_parameters(num_layers: int, hidden: int) -> int:
    """``models.families.mlp``: two h x h Linear layers with biases per residual block."""
    return num_layers * 2 * (hidden * hidden + hidden)


def mlp_layer_count(model_cfg: Mapping[str, Any]) -> int:
    return int(model_cfg["num_layers"])


def mlp_parameter_count(model_cfg: Mapping[str, Any]) -> int:
    return mlp_parameters(int(model_cfg["num_layers"]), int(model_cfg["hidden_size"]))


def mlp_config_flops(model_cfg: Mapping[str, Any], batch: int, recompute: bool, seq_len: int | None = None) -> float:
    """``seq_len`` does not apply: a sample is one vector."""
    return mlp_flops_per_iteration(batch, int(model_cfg["num_layers"]), int(model_cfg["hidden_size"]), recompute)
