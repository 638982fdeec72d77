"""NVIDIA apex, optional (``optim.impl=apex``): its FusedAdam / FusedSGD and FusedLayerNorm.

Used only where apex is installed (built from NVIDIA's repository; the registry package named
``apex`` is unrelated and is never what this means). ``check_apex`` runs before any process starts
and needs no torch: it looks for apex's ``optimizers/fused_adam.py`` beside the importable
package, which the unrelated package does not have. torch's fused/foreach optimizers stay the
default (``optim.impl=torch``).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from pipedream.errors import ConfigError

APEX_HINT = ("install NVIDIA apex from https://github.com/NVIDIA/apex (with its CUDA extensions), "
             "or use optim.impl=torch")


def apex_installed() -> bool:
    spec = importlib.util.find_spec("apex")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any((Path(place) / "optimizers" / "fused_adam.py").is_file() for place in spec.submodule_search_locations)


def check_apex(impl: str, device: str) -> None:
    """One line before launch when ``optim.impl=apex`` cannot run here."""
    if impl != "apex":
        return
    if not apex_installed():
        raise ConfigError(f"optim.impl=apex, but NVIDIA apex is not importable: {APEX_HINT}")
    if device == "cpu":
        raise ConfigError("optim.impl=apex needs cluster.device=cuda (apex's fused kernels are CUDA only): "
                          "use optim.impl=torch on CPU")


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
