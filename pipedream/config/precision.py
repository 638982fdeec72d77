"""``precision:`` (conf/precision/*.yaml), validated before any process group: the compute dtype
and, for fp16, the dynamic loss scaler's settings. Torch-free, like the other specs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipedream.errors import ConfigError
from pipedream.config.specs import Section

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class LossScaleSpec:
    initial_scale: float
    growth_factor: float
    growth_interval: int
    backoff_factor: float


@dataclass(frozen=True)
class PrecisionSpec:
    name: str                          # fp32 | bf16 | fp16
    loss_scale: LossScaleSpec | None   # fp16 only

    @classmethod
    def from_config(cls, cfg: Any, schedule: str, asynchronous: bool) -> PrecisionSpec:
        section = Section(cfg, "precision")
        name = section.raw("name")
        if name not in PRECISIONS:
            raise ConfigError(f"precision={name!r} is unknown: choose one of {', '.join(PRECISIONS)}")
        if name != "fp16":
            return cls(name, None)
        if asynchronous:
            raise ConfigError(f"precision=fp16 with schedule={schedule}: its stages update at different times, so "
                              f"no step exists that every rank could skip on an overflow; use precision=bf16 (no "
                              f"loss scaling needed) or a flush schedule (1f1b, gpipe, interleaved)")
        scale = LossScaleSpec(initial_scale=section.number("initial_scale"),
                              growth_factor=section.number("growth_factor"),
                              growth_interval=section.integer("growth_interval", 1),
                              backoff_factor=section.number("backoff_factor"))
        if not scale.initial_scale > 0 or not scale.growth_factor > 1 or not 0 < scale.backoff_factor < 1:
            raise ConfigError(f"precision loss scaling {vars(scale)} needs initial_scale > 0, growth_factor > 1 and "
                              f"0 < backoff_factor < 1: fix the precision.* overrides")
        return cls(name, scale)
