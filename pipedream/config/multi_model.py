"""``train.models`` and ``train.fusion_groups`` read into per-model settings (torch-free, so the
launcher refuses a bad sweep before anything starts)."""
from __future__ import annotations

from typing import Any

from pipedream.errors import ConfigError
from pipedream.multi_model.spec import ModelVariant, MultiModelSpec
from pipedream.schedules import schedule_info

OVERRIDABLE = ("seed", "lr", "weight_decay")   # what one model of a set may change


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key} = {value!r} must be a number: e.g. {key.rpartition('.')[2]}=0.001")
    return float(value)


def _variant(index: int, override: Any, seed: int, lr: float, weight_decay: float) -> ModelVariant:
    key = f"train.models[{index}]"
    if override is None:
        override = {}
    if not hasattr(override, "items"):
        raise ConfigError(f"{key} = {override!r} must be a mapping of overrides such as {{lr: 0.001, seed: 7}}: "
                          f"use train.models=K or a list of such mappings")
    unknown = sorted(set(override) - set(OVERRIDABLE))
    if unknown:
        raise ConfigError(f"{key} overrides {', '.join(map(str, unknown))}, which one model of a fused set cannot "
                          f"change: override only {', '.join(OVERRIDABLE)}")
    model_seed = override.get("seed", seed + index)
    if isinstance(model_seed, bool) or not isinstance(model_seed, int) or model_seed < 0:
        raise ConfigError(f"{key}.seed = {model_seed!r} must be a non-negative integer")
    model_lr = _number(override.get("lr", lr), f"{key}.lr")
    if model_lr <= 0:
        raise ConfigError(f"{key}.lr = {model_lr!r} must be positive")
    return ModelVariant(index, model_seed, model_lr, _number(override.get("weight_decay", weight_decay),
                                                               f"{key}.weight_decay"))


def multi_model_spec(cfg: Any) -> MultiModelSpec | None:
    """None for ordinary one-model training (``train.models`` null or 1 without overrides)."""
    models = cfg.train.get("models")
    if models is None:
        return None
    seed, lr = int(cfg.train.seed), float(cfg.train.lr)
    weight_decay = float(cfg.optim.get("weight_decay", 0.0) or 0.0)
    if isinstance(models, bool) or not (isinstance(models, int) or hasattr(models, "__len__")) or \
            isinstance(models, str):
        raise ConfigError(f"train.models = {models!r} must be a model count or a list of per-model overrides: "
                          f"e.g. train.models=4 or 'train.models=[{{lr:0.001}},{{lr:0.003}}]'")
    overrides = [None] * models if isinstance(models, int) else list(models)
    if not overrides:
        raise ConfigError("train.models is an empty list: give at least one model (or null for one)")
    variants = tuple(_variant(i, o, seed, lr, weight_decay) for i, o in enumerate(overrides))
    groups = cfg.train.get("fusion_groups", "auto")
    if groups != "auto" and (isinstance(groups, bool) or not isinstance(groups, int) or groups < 1
                             or len(variants) % groups):
        raise ConfigError(f"train.fusion_groups = {groups!r} must be auto or a positive divisor of the "
                          f"{len(variants)} models: e.g. train.fusion_groups=1 (all fused)")
    budget = (cfg.get("memory") or {}).get("device_budget_bytes")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ConfigError(f"memory.device_budget_bytes = {budget!r} must be a positive number of bytes: e.g. "
                          f"memory.device_budget_bytes=2000000000, or null for no budget")
    return MultiModelSpec(variants, None if groups == "auto" else groups, budget)


def check_multi_model(cfg: Any, schedule: str, asynchronous: bool, tp: int, optim_impl: str) -> MultiModelSpec | None:
    """What a fused set composes with (the settings alone; ``fused.build_fused_model`` then checks the
    layers); one ConfigError line otherwise."""
    spec = multi_model_spec(cfg)
    if spec is None:
        return None
    if asynchronous or schedule_info(schedule).memory_virtualised:   # harmony_pp swaps whole layers, not fused sets
        raise ConfigError(f"train.models with schedule={schedule}: fused model sets train with the flush "
                          f"schedules only (1f1b, gpipe, interleaved, zb_h2, zbv): choose one of them")
    if tp > 1:
        raise ConfigError(f"train.models with parallel.tp={tp}: a fused set does not split its layers over "
                          f"tensor-parallel ranks: set parallel.tp=1")
    if optim_impl == "apex":
        raise ConfigError("train.models with optim.impl=apex: per-model optimizer groups use torch's optimizers: "
                          "set optim.impl=torch")
    if str(cfg.precision.name) == "fp16":
        raise ConfigError("train.models with precision=fp16: one loss scale cannot serve several models: "
                          "use precision=bf16 or fp32")
    return spec
