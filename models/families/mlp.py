"""Residual Linear-GELU-Linear blocks with a mean-squared-error loss (tests and benchmarks)."""
from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.spec import LayerModel, seeded


class ResidualMLPBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, hidden)
        self.fc2 = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


def mlp_model(num_layers: int, hidden_size: int, seed: int = 0) -> LayerModel:
    def build_layer(i: int) -> nn.Module:
        return seeded(seed + i, partial(ResidualMLPBlock, hidden_size))

    def make_batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch_size, hidden_size, generator=generator)
        return x, torch.randn(batch_size, hidden_size, generator=generator)

    return LayerModel(name="mlp", num_layers=num_layers, build_layer=build_layer,
                      loss_fn=F.mse_loss, make_batch=make_batch)


def mlp_from_config(model_cfg: Any, seed: int = 0) -> LayerModel:
    """``model=mlp`` (``models.registry``)."""
    return mlp_model(num_layers=int(model_cfg["num_layers"]), hidden_size=int(model_cfg["hidden_size"]), seed=seed)
