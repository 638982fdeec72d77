"""VGG-16 and ResNet-50 as pipeline layers (torchvision's architectures and initialisation), built
from the layer descriptions in ``models.families.vision_facts``.

BatchNorm (ResNet-50) normalises each micro-batch by its own statistics, as any BatchNorm does in
the forward it runs; the single-process reference runs the same micro-batches, so training matches
it exactly (docs/models.md, "Vision models").
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.spec import LayerModel, seeded
from models.families.vision_facts import IMAGE_CHANNELS, VisionLayer, vgg16_layers, resnet50_layers


def _init_conv_and_norm(module: nn.Module) -> None:
    """torchvision's initialisation: Kaiming-normal (fan-out) convolutions with zero bias, BN at
    (1, 0)."""
    for sub in module.modules():
        if isinstance(sub, nn.Conv2d):
            nn.init.kaiming_normal_(sub.weight, mode="fan_out", nonlinearity="relu")
            if sub.bias is not None:
                nn.init.zeros_(sub.bias)
        elif isinstance(sub, nn.BatchNorm2d):
            nn.init.ones_(sub.weight)
            nn.init.zeros_(sub.bias)


class Bottleneck(nn.Module):
    def __init__(self, layer: VisionLayer, zero_init_residual: bool = False):
        super().__init__()
        cin, width, cout = layer.cin, layer.width, layer.cout
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=layer.stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride=layer.stride, bias=False), nn.BatchNorm2d(cout))
                           if layer.downsample else None)
        _init_conv_and_norm(self)
        if zero_init_residual:   # torchvision's option (Goyal et al. 2017): each block starts as identity
            nn.init.zeros_(self.bn3.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(out + identity)


def build_vision_layer(layer: VisionLayer, dropout: float, zero_init_residual: bool = False) -> nn.Module:
    """The module for one layer description."""
    if layer.kind == "vgg_conv":
        parts: list[nn.Module] = [nn.Conv2d(layer.cin, layer.cout, 3, padding=1), nn.ReLU()]
        if layer.pool:
            parts.append(nn.MaxPool2d(2, 2))
        module = nn.Sequential(*parts)
        _init_conv_and_norm(module)
        return module
    if layer.kind == "vgg_fc":
        linear = nn.Linear(layer.fc_inputs, layer.cout)
        nn.init.normal_(linear.weight, 0.0, 0.01)   # torchvision's VGG classifier
        nn.init.zeros_(linear.bias)
        parts = [nn.AdaptiveAvgPool2d(layer.pool_to), nn.Flatten()] if layer.pool_to else []
        parts.append(linear)
        if layer.activation:
            parts += [nn.ReLU(), nn.Dropout(dropout)]
        return nn.Sequential(*parts)
    if layer.kind == "stem":
        module = nn.Sequential(nn.Conv2d(layer.cin, layer.cout, 7, stride=2, padding=3, bias=False),
                               nn.BatchNorm2d(layer.cout), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
        _init_conv_and_norm(module)
        return module
    if layer.kind == "bottleneck":
        return Bottleneck(layer, zero_init_residual)
    if layer.kind == "head":   # torchvision keeps nn.Linear's default initialisation here
        return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(layer.cin, layer.cout))
    raise ValueError(f"unknown vision layer kind {layer.kind!r}")


def _vision_model(name: str, layers: list[VisionLayer], image_size: int, num_classes: int, dropout: float,
                  seed: int, zero_init_residual: bool = False) -> LayerModel:
    def build_layer(i: int) -> nn.Module:
        return seeded(seed + i, partial(build_vision_layer, layers[i], dropout, zero_init_residual))

    def make_batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.randn(batch_size, IMAGE_CHANNELS, image_size, image_size, generator=generator)
        return images, torch.randint(0, num_classes, (batch_size,), generator=generator)

    return LayerModel(name=name, num_layers=len(layers), build_layer=build_layer, loss_fn=F.cross_entropy,
                      make_batch=make_batch)


def vgg16_model(image_size: int = 224, num_classes: int = 1000, width_multiplier: float = 1.0,
                dropout: float = 0.5, seed: int = 0) -> LayerModel:
    return _vision_model("vgg16", vgg16_layers(image_size, num_classes, width_multiplier), image_size, num_classes,
                         dropout, seed)


def resnet50_model(image_size: int = 224, num_classes: int = 1000, width_multiplier: float = 1.0,
                   zero_init_residual: bool = False, seed: int = 0) -> LayerModel:
    return _vision_model("resnet50", resnet50_layers(image_size, num_classes, width_multiplier), image_size,
                         num_classes, 0.0, seed, zero_init_residual)


def _image_sizes(model_cfg: Any) -> dict[str, Any]:
    return dict(image_size=int(model_cfg["image_size"]), num_classes=int(model_cfg["num_classes"]),
                width_multiplier=float(model_cfg["width_multiplier"]))


def vgg16_from_config(model_cfg: Any, seed: int = 0) -> LayerModel:
    """``model=vgg16`` and its small preset (``models.registry``)."""
    return vgg16_model(**_image_sizes(model_cfg), dropout=float(model_cfg["dropout"]), seed=seed)


def resnet50_from_config(model_cfg: Any, seed: int = 0) -> LayerModel:
    """``model=resnet50`` and its small preset (``models.registry``)."""
    return resnet50_model(**_image_sizes(model_cfg), zero_init_residual=bool(model_cfg["zero_init_residual"]), seed=seed)
