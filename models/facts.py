"""What a model config implies, computed in one place: pipeline layers, parameters and FLOPs, each
from its family's facts (``models.registry``). The runtime (run spec, plan files, metrics) and the
planner's analytic specs all read these, so a plan made for a model always describes the model the
trainer builds.

Torch-free: ``model_cfg`` is the Hydra ``model`` group or any mapping with the same keys.
"""
from __future__ import annotations

from typing import Any, Mapping

from models.registry import model_family


def pipeline_layer_count(model_cfg: Mapping[str, Any]) -> int:
    """Layers a pipeline splits: blocks plus embedding and head for GPT and BERT; VGG-16 and
    ResNet-50 their fixed layer lists (``vision_facts``); the MLP its ``num_layers`` blocks."""
    return model_family(model_cfg["name"]).layer_count(model_cfg)


def parameter_count(model_cfg: Mapping[str, Any]) -> int:
    """Parameters of the model ``models.build_model(model_cfg)`` builds (dense, tp = 1)."""
    return model_family(model_cfg["name"]).parameter_count(model_cfg)


def flops_per_iteration(model_cfg: Mapping[str, Any], batch: int, recompute: bool, seq_len: int | None = None) -> float:
    """Model FLOPs of one training iteration over ``batch`` samples (the numerator of MFU).

    A recomputed forward counts when the run recomputes, as in eq. 4.2's hardware-FLOPs accounting;
    ``seq_len`` (sequence families) defaults to the model's context.
    """
    return model_family(model_cfg["name"]).flops_per_iteration(model_cfg, batch, recompute, seq_len)


def flops_per_sample(model_cfg: Mapping[str, Any], recompute: bool, seq_len: int | None = None) -> float:
    return flops_per_iteration(model_cfg, 1, recompute, seq_len)
