"""A fused model set's settings, as ``pipedream.config.multi_model`` reads them from ``train.models``:
plain data, below everything that builds or trains the set."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelVariant:
    """One model of a fused set: it trains as a run with ``train.seed=seed`` (initial weights, data
    set and data order) and these optimizer settings would train alone."""

    index: int
    seed: int
    lr: float
    weight_decay: float


@dataclass(frozen=True)
class MultiModelSpec:
    variants: tuple[ModelVariant, ...]
    fusion_groups: int | None      # None: chosen by a timing at start-up
    device_budget_bytes: int | None = None   # memory.device_budget_bytes: swap or recompute feature maps

    @property
    def count(self) -> int:
        return len(self.variants)
