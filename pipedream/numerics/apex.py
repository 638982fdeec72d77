"""NVIDIA apex, optional (``optim.impl=apex``): its FusedAdam / FusedSGD and FusedLayerNorm.

Used only where apex is installed (built from NVIDIA's repository; the registry package named
``apex`` is unrelated and is never what this means); ``pipedream.config.apex_check`` refuses
``optim.impl=apex`` before launch where it cannot run. torch's fused/foreach optimizers stay the
default (``optim.impl=torch``).
"""
from __future__ import annotations

from typing import Any

from pipedream.config.apex_check import APEX_HINT
from pipedream.errors import ConfigError


def apex_optimizer(name: str, groups: list[dict[str, Any]], **options: Any) -> Any:
    """apex's fused optimizer for ``optim.name`` (AdamW: FusedAdam in its decoupled-decay mode)."""
    try:
        from apex.optimizers import FusedAdam, FusedSGD
    except ImportError as error:
        raise ConfigError(f"optim.impl=apex, but apex.optimizers does not import ({error}): {APEX_HINT}") from None
    if name == "adamw":
        return FusedAdam(groups, adam_w_mode=True, **options)
    return FusedSGD(groups, **options)


def use_apex_layer_norm(module: Any) -> int:
    """Switches every ``nn.LayerNorm`` in ``module`` to apex's FusedLayerNorm in place (same
    parameters and state dict); returns how many."""
    from torch import nn
    try:
        from apex.normalization import FusedLayerNorm
    except ImportError as error:
        raise ConfigError(f"optim.impl=apex, but apex.normalization does not import ({error}): {APEX_HINT}") from None
    count = 0
    for layer in module.modules():
        if type(layer) is nn.LayerNorm and layer.elementwise_affine:
            layer.__class__ = FusedLayerNorm
            layer.memory_efficient = False   # an attribute FusedLayerNorm's forward reads
            count += 1
    return count
