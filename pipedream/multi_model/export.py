"""A fused set's consolidated state (``<layer>.models.<k>.<name>``) as K single-model state dicts
(``<layer>.<name>``, what ``build_sequential()`` of one model loads). Torch-free."""
from __future__ import annotations

from typing import Any

MARK = ".models."


def is_fused_state(state: dict[str, Any]) -> bool:
    return bool(state) and all(MARK in key for key in state)


def split_models(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Model k's parameters and buffers by its own names, for every k."""
    models: dict[int, dict[str, Any]] = {}
    for key, value in state.items():
        layer, _, rest = key.partition(MARK)
        index, _, name = rest.partition(".")
        models.setdefault(int(index), {})[f"{layer}.{name}"] = value
    return [models[k] for k in sorted(models)]


def model_paths(out: Any, count: int) -> list[Any]:
    """``model.pt`` -> ``model_0.pt`` ... ``model_<K-1>.pt`` beside it."""
    return [out.with_name(f"{out.stem}_{k}{out.suffix}") for k in range(count)]
