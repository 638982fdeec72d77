"""Trainable models as ordered layer lists (see ``models.spec.LayerModel``).

The torch-backed names load lazily, so ``models.formulas`` and ``models.facts`` (used by the
planner's dry run) do not pay for importing torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pipedream.errors import ConfigError

from .facts import option, pipeline_layer_count

if TYPE_CHECKING:
    from pipedream.tensor_parallel import TensorParallel

    from .spec import LayerModel

_LAZY = {"bert_model": ".bert", "gpt_model": ".gpt", "mlp_model": ".mlp", "LayerModel": ".spec",
         "PipelineSequential": ".spec", "from_modules": ".contract"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


TRAINABLE_MODELS = ("gpt", "bert", "mlp")


def check_tensor_parallel_config(model_cfg: Any, tp: int) -> None:
    """One-line ConfigError if the model cannot be split over ``tp`` tensor-parallel ranks; run it
    before creating any process group."""
    if tp == 1:
        return
    name = model_cfg.get("name") or f"{model_cfg.get('_target_')} (a plugin)"
    if name not in ("gpt", "bert"):
        raise ConfigError(f"model={name} has no tensor-parallel form but parallel.tp={tp}: set parallel.tp=1 "
                          f"or train model=gpt_tiny / model=bert_tiny")
    from .gpt import check_tensor_parallel
    check_tensor_parallel(int(model_cfg["hidden_size"]), int(model_cfg["num_heads"]), tp)


def build_model(model_cfg: Any, seed: int = 0, tp: TensorParallel | None = None) -> LayerModel:
    """``model_cfg`` is the Hydra ``model`` group (or any mapping with the same keys). With ``tp``
    (a ``TensorParallel`` context) GPT and BERT are built as this rank's tensor-parallel slice."""
    from .bert import bert_model
    from .gpt import gpt_model
    from .mlp import mlp_model

    if model_cfg.get("_target_") is not None:   # a plugin (docs/models.md)
        from pipedream.plugins import plugin_model
        check_tensor_parallel_config(model_cfg, 1 if tp is None else tp.size)
        return plugin_model(model_cfg, seed)
    name = model_cfg["name"]
    if model_cfg.get("planner_only"):
        raise ConfigError(f"model={model_cfg.get('preset') or name} is planner-only (analytic sizes): "
                          f"train a small preset instead (e.g. model=gpt_tiny or model=bert_tiny)")
    if name in ("gpt", "bert"):
        common = dict(num_layers=int(model_cfg["num_layers"]), hidden_size=int(model_cfg["hidden_size"]),
                      num_heads=int(model_cfg["num_heads"]), seq_len=int(model_cfg["seq_len"]),
                      vocab_size=int(option(model_cfg, "vocab_size")),
                      tie_embeddings=bool(option(model_cfg, "tie_embeddings")),
                      dropout=float(option(model_cfg, "dropout")), seed=seed, tp=tp)
        if name == "gpt":
            return gpt_model(**common)
        return bert_model(**common, pre_ln=bool(option(model_cfg, "pre_ln")),
                          mask_fraction=float(option(model_cfg, "mask_fraction")))
    if name == "mlp":
        check_tensor_parallel_config(model_cfg, 1 if tp is None else tp.size)
        return mlp_model(num_layers=int(model_cfg["num_layers"]), hidden_size=int(model_cfg["hidden_size"]),
                         seed=seed)
    raise ValueError(f"model.name={name!r} cannot be trained; trainable models are {list(TRAINABLE_MODELS)}")


__all__ = ["LayerModel", "PipelineSequential", "TRAINABLE_MODELS", "from_modules", "bert_model", "build_model", "check_tensor_parallel_config", "gpt_model",
           "mlp_model", "pipeline_layer_count"]
