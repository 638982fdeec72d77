"""Plugin targets for the tests: one good model and data set, and one broken plugin per rule the
pre-check enforces (``models.plugins``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from models import LayerModel, from_modules


def good_model(width: int = 8) -> LayerModel:
    layers = nn.Sequential(nn.Linear(4, width), nn.Sequential(nn.GELU(), nn.Linear(width, 2)))
    return from_modules(layers, F.mse_loss, (torch.randn(2, 4), torch.randn(2, 2)))


def good_data(samples: int = 16) -> tuple[TensorDataset, TensorDataset]:
    return (TensorDataset(torch.randn(samples, 4), torch.randn(samples, 2)),
            TensorDataset(torch.randn(samples, 4), torch.randn(samples, 2)))


def returns_a_module() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 2))


def shapes_do_not_chain() -> LayerModel:
    layers = [nn.Linear(4, 8), nn.Linear(6, 2)]
    return from_modules(layers, F.mse_loss, (torch.randn(2, 4), torch.randn(2, 2)))


def loss_not_scalar() -> LayerModel:
    layers = [nn.Linear(4, 2)]
    return from_modules(layers, lambda out, y: F.mse_loss(out, y, reduction="none"),
                        (torch.randn(2, 4), torch.randn(2, 2)))


def raises(width: int) -> LayerModel:
    raise RuntimeError(f"no model of width {width}")


not_callable = 3


def data_not_a_pair() -> TensorDataset:
    return good_data()[0]


def data_bad_samples() -> tuple[list, list]:
    return [1, 2], [3]


def data_unpaired_samples() -> tuple[TensorDataset, TensorDataset]:
    return TensorDataset(torch.randn(4, 4)), TensorDataset(torch.randn(4, 4))


def loss_not_a_tensor() -> LayerModel:
    return from_modules([nn.Linear(4, 2)], lambda out, y: 0.5, (torch.randn(2, 4), torch.randn(2, 2)))


class ToDict(nn.Module):
    def forward(self, x: torch.Tensor) -> dict:
        return {"x": x}


def layer_returns_a_dict() -> LayerModel:
    return from_modules([nn.Linear(4, 2), ToDict()], F.mse_loss, (torch.randn(2, 4), torch.randn(2, 2)))


def tied_across_layers() -> LayerModel:
    shared = nn.Linear(4, 4)
    return from_modules([shared, nn.GELU(), nn.Linear(4, 4), shared], F.mse_loss, (torch.randn(2, 4), torch.randn(2, 4)))


def tied_data(samples: int = 64) -> tuple[TensorDataset, TensorDataset]:
    x = torch.randn(samples, 4)
    return TensorDataset(x[:48], torch.sin(x[:48])), TensorDataset(x[48:], torch.sin(x[48:]))


def data_too_wide() -> tuple[TensorDataset, TensorDataset]:
    return (TensorDataset(torch.randn(8, 5), torch.randn(8, 2)),) * 2


class AccumulateInPlace(nn.Module):
    """Adds its input into a tensor it creates: fine alone, but under torch.vmap that tensor has
    no model dimension and an in-place add of the batched input cannot fit in it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        total += x
        return total


def accumulates_in_place() -> LayerModel:
    return from_modules(nn.Sequential(nn.Linear(4, 8), AccumulateInPlace(), nn.Linear(8, 2)), F.mse_loss,
                        (torch.randn(2, 4), torch.randn(2, 2)))
