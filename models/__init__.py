"""Trainable models as ordered layer lists (see ``models.spec.LayerModel``): the built-in families
of ``models.registry``, and plugins (``model._target_``, docs/models.md).

The torch-backed names load lazily, so ``models.registry`` and ``models.facts`` (used by the
planner's dry run) do not pay for importing torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from models.errors import ConfigError

from models.facts import pipeline_layer_count
from models.plugin_config import plugin_target
from models.registry import MODEL_FAMILIES, known_family, model_family

if TYPE_CHECKING:
    from models.context_parallel import ContextParallel
    from models.expert_parallel import ExpertParallel
    from models.plugins import CheckedModel
    from models.tensor_parallel import TensorParallel

    from models.spec import LayerModel

_LAZY = {"bert_model": ".families.bert", "gpt_model": ".families.gpt", "mlp_model": ".families.mlp", "LayerModel": ".spec",
         "vgg16_model": ".families.vision", "resnet50_model": ".families.vision",
         "PipelineSequential": ".spec", "from_modules": ".contract",
         "CoreAttention": ".attention"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


TRAINABLE_MODELS = tuple(MODEL_FAMILIES)   # the family names, in registry order


def check_tensor_parallel_config(model_cfg: Any, tp: int) -> None:
    """One-line ConfigError if the model cannot be split over ``tp`` tensor-parallel ranks; run it
    before creating any process group."""
    if tp == 1:
        return
    family = known_family(model_cfg.get("name"))
    if family is None or family.tensor_parallel is None:
        name = model_cfg.get("name") or f"{model_cfg.get('_target_')} (a plugin)"
        raise ConfigError(f"model={name} has no tensor-parallel form but parallel.tp={tp}: set parallel.tp=1 "
                          f"or train model=gpt_tiny / model=bert_tiny")
    family.check_tensor_parallel(model_cfg, tp)


def check_context_parallel_config(model_cfg: Any, cp: int) -> None:
    """One-line ConfigError if the model has no context-parallel form but ``cp`` > 1 ranks."""
    if cp == 1:
        return
    family = known_family(model_cfg.get("name"))
    if family is None or not family.context_parallel:
        name = model_cfg.get("name") or f"{model_cfg.get('_target_')} (a plugin)"
        raise ConfigError(f"model={name} has no context-parallel form but context-parallel size cp={cp}: "
                          f"use cp=1 or a gpt / llama / hf model")


def check_expert_parallel_config(model_cfg: Any, ep: int, replicas: int | None = None) -> None:
    """One-line ConfigErrors if ``ep`` > 1 expert-parallel ranks cannot split the model's experts
    (an MoE llama model or a Hugging Face MoE decoder, ``num_experts`` divisible by ep) or, with
    ``replicas`` (dp x cp of a stage), cannot be taken from those ranks. Needs no process group."""
    if ep == 1:
        return
    from models.families.moe_facts import moe_config   # torch-free
    name = model_cfg.get("name") or f"{model_cfg.get('_target_')} (a plugin)"
    moe = moe_config(model_cfg) if model_cfg.get("name") == "llama" else None   # the families with MoE layers
    if model_cfg.get("name") == "hf":
        from models.families.hf_facts import read_hf_config
        from models.families.hf_moe_facts import hf_moe_config
        moe = hf_moe_config(read_hf_config(model_cfg))
    if moe is None:
        raise ConfigError(f"parallel.ep={ep} but model={name} has no MoE layers: set parallel.ep=1 or use an MoE "
                          f"model (model.moe.num_experts > 0, e.g. model=mixtral_tiny)")
    if moe.num_experts % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide model.moe.num_experts={moe.num_experts}: choose an ep "
                          f"that divides the expert count")
    if replicas is not None and replicas % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide parallel.dp*cp={replicas} (expert-parallel ranks are "
                          f"taken from a stage's data- and context-parallel ranks): choose an ep dividing {replicas}")


def build_model(model_cfg: Any, seed: int = 0, tp: TensorParallel | None = None,
                cp: ContextParallel | None = None, ep: ExpertParallel | None = None) -> LayerModel:
    """``model_cfg`` is the Hydra ``model`` group (or any mapping with the same keys). With ``tp``
    (a ``TensorParallel`` context) a tensor-parallel family is built as this rank's slice. With
    ``cp`` (a ``ContextParallel`` context of size > 1) a context-parallel family is built to take
    this rank's zigzag shard of each sequence; a ``cp`` of size 1 changes nothing. With ``ep`` (an
    ``ExpertParallel`` context of size > 1) an MoE model holds this rank's experts only."""
    tp_size = 1 if tp is None else tp.size
    ep = None if ep is None or ep.size == 1 else ep
    check_expert_parallel_config(model_cfg, 1 if ep is None else ep.size)
    cp = None if cp is None or cp.size == 1 else cp   # as models.group_context.splitting, without torch
    check_context_parallel_config(model_cfg, 1 if cp is None else cp.size)
    if plugin_target(model_cfg) is not None:   # a plugin (docs/models.md)
        from models.plugins import plugin_model
        check_tensor_parallel_config(model_cfg, tp_size)
        return plugin_model(model_cfg, seed)
    if model_cfg.get("planner_only"):
        raise ConfigError(f"model={model_cfg.get('preset') or model_cfg['name']} is planner-only (analytic sizes): "
                          f"train a small preset instead (e.g. model=gpt_tiny or model=bert_tiny)")
    family = model_family(model_cfg["name"])
    check_tensor_parallel_config(model_cfg, tp_size)
    return family.build(model_cfg, seed, tp, cp, ep)


__all__ = ["CoreAttention", "LayerModel", "MODEL_FAMILIES", "PipelineSequential", "TRAINABLE_MODELS", "from_modules", "bert_model",
           "build_model", "check_context_parallel_config", "check_expert_parallel_config", "check_tensor_parallel_config", "checked_plugin",
           "gpt_model", "layer_count", "mlp_model", "model_family",
           "pipeline_layer_count", "resnet50_model", "vgg16_model"]


def checked_plugin(model_cfg: Any) -> CheckedModel | None:
    """The plugin model of ``model._target_``, imported, built and checked on the meta device
    (``models.plugins.checked_model``), or None for a built-in family. A run reads it once and
    passes it on (``apply_plan``, ``build_run_spec``): the user's code runs once per check."""
    if plugin_target(model_cfg) is None:
        return None
    from models.plugins import checked_model   # torch and the user's code, only for plugins

    return checked_model(model_cfg)


def layer_count(model_cfg: Any, plugin: CheckedModel | None = None) -> int:
    """Pipeline layers of the configured model; a plugin's from ``plugin`` (read here when not given)."""
    if plugin_target(model_cfg) is None:
        return pipeline_layer_count(model_cfg)
    return (plugin if plugin is not None else checked_plugin(model_cfg)).model.num_layers

