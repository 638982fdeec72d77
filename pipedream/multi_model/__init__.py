"""Multi-model training (μ-two): K variants of one model trained in one job, their layers fused
(docs/multi_model.md). ``settings`` is torch-free; the rest loads with torch."""
from __future__ import annotations

from typing import Any

from .settings import ModelVariant, MultiModelSpec, check_multi_model, multi_model_spec

__all__ = ["ModelVariant", "MultiModelSpec", "check_multi_model", "multi_model_spec", "build_fused_model"]


def build_fused_model(cfg: Any, multi: MultiModelSpec) -> Any:
    """The fused ``LayerModel`` of the K variants (each built as a run with its seed builds it);
    ``ConfigError`` naming the layer that cannot fuse and why."""
    from models import build_model
    from pipedream.errors import ConfigError

    from .fused import NotFusableError, check_fusable, fuse_models

    members = [build_model(cfg.model, seed=variant.seed) for variant in multi.variants]
    try:
        fused = fuse_models(members, multi, groups=multi.fusion_groups or 1)
        check_fusable(fused)
    except NotFusableError as error:
        raise ConfigError(f"train.models={multi.count}: {error}: train these models one by one "
                          f"(train.models=null)") from None
    return fused
