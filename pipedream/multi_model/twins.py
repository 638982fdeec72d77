"""Batched twins: the layer types whose K copies run as one kernel on stacked parameters.

A twin holds its module's parameters and buffers stacked along a leading model dimension
(``[K, ...]``, the same names) and takes its input with the model dimension folded into the batch
dimension (``[K*B, ...]``, model k's samples at ``k*B .. k*B+B-1``), so the code of the layer around
it runs unchanged: a Linear becomes one ``baddbmm``, a LayerNorm one normalisation and one stacked
affine, an Embedding one lookup in the K tables seen as one, a convolution one grouped convolution,
a batch norm one call over K*C channels; attention, activations and dropout already treat the K*B
samples as one batch. A twin reads K from its weight (a fused group passes a slice of the stacks).

``batched_twin`` builds the twin of a module, or returns None for a type (or a setting) that has
none: a layer holding such a module runs under ``torch.vmap`` instead (``fused``).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


def _models(weight: torch.Tensor) -> int:
    return weight.shape[0]


class BatchedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias   # [K, out, in], [K, out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(_models(self.weight), -1, x.shape[-1])
        weight = self.weight.transpose(1, 2)
        y = torch.bmm(flat, weight) if self.bias is None else torch.baddbmm(self.bias.unsqueeze(1), flat, weight)
        return y.view(*x.shape[:-1], y.shape[-1])


class BatchedLayerNorm(nn.Module):
    def __init__(self, norm: nn.LayerNorm):
        super().__init__()
        self.normalized_shape, self.eps = tuple(norm.normalized_shape), norm.eps
        self.weight, self.bias = norm.weight, norm.bias   # [K, *normalized_shape]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x, self.normalized_shape, eps=self.eps)
        flat = y.reshape(_models(self.weight), -1, *self.normalized_shape)
        weight = self.weight.unsqueeze(1)
        out = flat * weight if self.bias is None else torch.addcmul(self.bias.unsqueeze(1), flat, weight)
        return out.view(x.shape)


class BatchedEmbedding(nn.Module):
    """The K tables as one of K*V rows; model k's indices are offset by k*V."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.weight = embedding.weight   # [K, V, H]

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        count, rows, width = self.weight.shape
        grouped = indices.reshape(count, -1, *indices.shape[1:])
        offsets = torch.arange(0, count * rows, rows, device=indices.device).view(count, *([1] * indices.dim()))
        return F.embedding(grouped + offsets, self.weight.reshape(count * rows, width)).view(*indices.shape, width)


def _channels_of_models(x: torch.Tensor, count: int) -> torch.Tensor:
    """[K*B, C, ...] -> [B, K*C, ...]: model k's channels at k*C .. k*C+C-1."""
    grouped = x.reshape(count, -1, *x.shape[1:])
    return grouped.transpose(0, 1).reshape(grouped.shape[1], -1, *x.shape[2:])


def _models_of_channels(y: torch.Tensor, count: int) -> torch.Tensor:
    """The inverse of ``_channels_of_models``."""
    grouped = y.reshape(y.shape[0], count, -1, *y.shape[2:])
    return grouped.transpose(0, 1).reshape(-1, *grouped.shape[2:])


class BatchedConv(nn.Module):
    """K convolutions as one with ``groups`` multiplied by K over the models' stacked channels."""

    def __init__(self, conv: nn.modules.conv._ConvNd):
        super().__init__()
        self.weight, self.bias = conv.weight, conv.bias   # [K, out, in/groups, *kernel], [K, out]
        self.options = dict(stride=conv.stride, padding=conv.padding, dilation=conv.dilation)
        self.groups = conv.groups
        self.function = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[len(conv.kernel_size)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        count = _models(self.weight)
        weight = self.weight.reshape(-1, *self.weight.shape[2:])
        bias = None if self.bias is None else self.bias.reshape(-1)
        y = self.function(_channels_of_models(x, count), weight, bias, groups=self.groups * count, **self.options)
        return _models_of_channels(y, count)


class BatchedBatchNorm(nn.Module):
    """K batch norms as one over K*C channels: each model's statistics from its own samples."""

    def __init__(self, norm: nn.modules.batchnorm._BatchNorm):
        super().__init__()
        self.weight, self.bias = norm.weight, norm.bias                    # [K, C]
        self.register_buffer("running_mean", norm.running_mean)          # [K, C]
        self.register_buffer("running_var", norm.running_var)
        self.register_buffer("num_batches_tracked", norm.num_batches_tracked)   # [K]
        self.momentum, self.eps = norm.momentum, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        count = self.running_mean.shape[0]
        if self.training:
            self.num_batches_tracked.add_(1)
        flat = (lambda t: None if t is None else t.reshape(-1))
        y = F.batch_norm(_channels_of_models(x, count), flat(self.running_mean), flat(self.running_var),
                         flat(self.weight), flat(self.bias), self.training, self.momentum, self.eps)
        return _models_of_channels(y, count)


def _embedding(module: nn.Embedding) -> nn.Module | None:
    plain = module.padding_idx is None and module.max_norm is None and not module.sparse
    return BatchedEmbedding(module) if plain else None


def _conv(module: nn.modules.conv._ConvNd) -> nn.Module | None:
    plain = module.padding_mode == "zeros" and not module.transposed and not isinstance(module.padding, str)
    return BatchedConv(module) if plain else None


def _batch_norm(module: nn.modules.batchnorm._BatchNorm) -> nn.Module | None:
    # the cumulative average (momentum None) and untracked statistics keep vmap's semantics
    plain = module.track_running_stats and module.momentum is not None and module.running_mean is not None
    return BatchedBatchNorm(module) if plain else None


def _layer_norm(module: nn.LayerNorm) -> nn.Module | None:
    return BatchedLayerNorm(module) if module.weight is not None else None


TWINS: MappingProxyType[type, Callable[[nn.Module], nn.Module | None]] = MappingProxyType({
    nn.Linear: BatchedLinear, nn.LayerNorm: _layer_norm, nn.Embedding: _embedding,
    nn.Conv1d: _conv, nn.Conv2d: _conv, nn.Conv3d: _conv,
    nn.BatchNorm1d: _batch_norm, nn.BatchNorm2d: _batch_norm, nn.BatchNorm3d: _batch_norm,
})


def batched_twin(module: nn.Module) -> nn.Module | None:
    """The twin of ``module`` (its parameters already stacked), or None where it has none."""
    make = TWINS.get(type(module))
    return make(module) if make is not None else None


def holds_state(module: nn.Module) -> bool:
    """Holds parameters or buffers of its own (not only through submodules)."""
    return any(p is not None for p in module._parameters.values()) or \
        any(b is not None for b in module._buffers.values())
