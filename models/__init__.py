"""Trainable models as ordered layer lists (see ``models.spec.LayerModel``)."""
from __future__ import annotations

from typing import Any

from .gpt import gpt_model
from .mlp import mlp_model
from .spec import LayerModel

TRAINABLE_MODELS = ("gpt", "mlp")


def build_model(model_cfg: Any, seed: int = 0) -> LayerModel:
    """``model_cfg`` is the Hydra ``model`` group (or any mapping with the same keys)."""
    name = model_cfg["name"]
    if name == "gpt":
        return gpt_model(num_layers=int(model_cfg["num_layers"]), hidden_size=int(model_cfg["hidden_size"]),
                         num_heads=int(model_cfg["num_heads"]), seq_len=int(model_cfg["seq_len"]),
                         vocab_size=int(model_cfg.get("vocab_size", 256)),
                         tie_embeddings=bool(model_cfg.get("tie_embeddings", True)),
                         dropout=float(model_cfg.get("dropout", 0.0)), seed=seed)
    if name == "mlp":
        return mlp_model(num_layers=int(model_cfg["num_layers"]), hidden_size=int(model_cfg["hidden_size"]),
                         seed=seed)
    raise ValueError(f"model.name={name!r} cannot be trained; trainable models are {list(TRAINABLE_MODELS)}")


__all__ = ["LayerModel", "TRAINABLE_MODELS", "build_model", "gpt_model", "mlp_model"]
