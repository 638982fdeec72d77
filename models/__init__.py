"""Trainable models as ordered layer lists (see ``models.spec.LayerModel``).

The torch-backed names load lazily, so ``models.formulas`` and ``models.facts`` (used by the
planner's dry run) do not pay for importing torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from models.errors import ConfigError

from models.facts import option, pipeline_layer_count
from models.plugin_config import plugin_target
from models.vision_facts import VISION_MODELS

if TYPE_CHECKING:
    from models.tensor_parallel import TensorParallel

    from models.spec import LayerModel

_LAZY = {"bert_model": ".bert", "gpt_model": ".gpt", "mlp_model": ".mlp", "LayerModel": ".spec",
         "vgg16_model": ".vision", "resnet50_model": ".vision",
         "PipelineSequential": ".spec", "from_modules": ".contract"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


TRAINABLE_MODELS = ("gpt", "bert", "mlp", *VISION_MODELS)


def check_tensor_parallel_config(model_cfg: Any, tp: int) -> None:
    """One-line ConfigError if the model cannot be split over ``tp`` tensor-parallel ranks; run it
    before creating any process group."""
    if tp == 1:
        return
    name = model_cfg.get("name") or f"{model_cfg.get('_target_')} (a plugin)"
    if name not in ("gpt", "bert"):
        raise ConfigError(f"model={name} has no tensor-parallel form but parallel.tp={tp}: set parallel.tp=1 "
                          f"or train model=gpt_tiny / model=bert_tiny")
    from models.gpt import check_tensor_parallel
    check_tensor_parallel(int(model_cfg["hidden_size"]), int(model_cfg["num_heads"]), tp)


def build_model(model_cfg: Any, seed: int = 0, tp: TensorParallel | None = None) -> LayerModel:
    """``model_cfg`` is the Hydra ``model`` group (or any mapping with the same keys). With ``tp``
    (a ``TensorParallel`` context) GPT and BERT are built as this rank's tensor-parallel slice."""
    from models.bert import bert_model
    from models.gpt import gpt_model
    from models.mlp import mlp_model

    if model_cfg.get("_target_") is not None:   # a plugin (docs/models.md)
        from models.plugins import plugin_model
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
    if name in VISION_MODELS:
        check_tensor_parallel_config(model_cfg, 1 if tp is None else tp.size)
        return vision_model(model_cfg, seed)
    raise ValueError(f"model.name={name!r} cannot be trained; trainable models are {list(TRAINABLE_MODELS)}")


def vision_model(model_cfg: Any, seed: int) -> LayerModel:
    """``model=vgg16`` / ``model=resnet50`` (and their small presets)."""
    from models.vision import resnet50_model, vgg16_model
    sizes = dict(image_size=int(model_cfg["image_size"]), num_classes=int(model_cfg["num_classes"]),
                 width_multiplier=float(model_cfg["width_multiplier"]), seed=seed)
    if model_cfg["name"] == "vgg16":
        return vgg16_model(**sizes, dropout=float(model_cfg["dropout"]))
    return resnet50_model(**sizes, zero_init_residual=bool(model_cfg["zero_init_residual"]))


__all__ = ["LayerModel", "PipelineSequential", "TRAINABLE_MODELS", "from_modules", "bert_model", "build_model", "check_tensor_parallel_config", "gpt_model",
           "layer_count", "mlp_model", "pipeline_layer_count", "resnet50_model", "vgg16_model"]


def layer_count(model_cfg: Any) -> int:
    """Pipeline layers of the configured model; a plugin is built (and checked) to count them."""
    if plugin_target(model_cfg) is None:
        return pipeline_layer_count(model_cfg)
    from models.plugins import checked_model   # torch and the user's code, only for plugins

    return checked_model(model_cfg).model.num_layers
