"""VGG-16 and ResNet-50 as pipeline layers, described without torch: the one definition that
``models.families.vision`` builds modules from and the planner costs (``planner.inputs.model_specs``), so both
count the same parameters and FLOPs.

The architectures are torchvision's (``vgg16``: 13 convolutions with ReLU, 5 max-pools, an
adaptive 7x7 average pool and three fully-connected layers; ``resnet50``: v1.5, the stride on the
3x3 convolution). ``width_multiplier`` scales every channel count and VGG's 4096 hidden units
(small presets for tests); at 1.0 and 1000 classes the parameter counts are torchvision's
(138,357,544 and 25,557,032). Pipeline layers: VGG-16 has 16 (each convolution with its ReLU and
the max-pool after it; the average pool and flatten go with fc1), ResNet-50 18 (stem, 16
bottleneck blocks, pooled classifier).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from models.errors import ConfigError

REQUIRED_KEYS = ("image_size", "num_classes")
IMAGE_CHANNELS = 3
VGG16_CONVS = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")
VGG_POOLED_SIZE = 7          # torchvision: AdaptiveAvgPool2d((7, 7)) before the classifier
VGG_HIDDEN = 4096
RESNET50_STAGES = ((64, 3), (128, 4), (256, 6), (512, 3))   # (bottleneck width, blocks)
RESNET_STEM = 64
EXPANSION = 4                # a bottleneck's output channels per unit of width


def scaled(channels: int, width_multiplier: float) -> int:
    return max(1, int(round(channels * width_multiplier)))


def conv_out(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


@dataclass(frozen=True)
class VisionLayer:
    """One pipeline layer. ``kind``: vgg_conv (3x3 conv + ReLU [+ 2x2 max-pool]), vgg_fc (Linear
    [+ ReLU + Dropout]; ``pool_to`` > 0: adaptive average pool and flatten first), stem (7x7/2 conv,
    BN, ReLU, 3x3/2 max-pool), bottleneck (1x1, 3x3/stride, 1x1 expanding, BN after each, residual
    with a 1x1 projection when ``downsample``), head (global average pool, Linear).
    Sizes are per sample: ``in_hw`` / ``out_hw`` are the square input and output side."""

    name: str
    kind: str
    cin: int
    cout: int
    in_hw: int = 1
    out_hw: int = 1
    width: int = 0           # bottleneck: inner channels
    stride: int = 1
    pool: bool = False       # vgg_conv: max-pool after the ReLU
    downsample: bool = False
    activation: bool = True  # vgg_fc: ReLU + Dropout after the Linear
    pool_to: int = 0         # vgg_fc: adaptive average pool to pool_to x pool_to before flattening

    @property
    def parameters(self) -> int:
        c, o, w = self.cin, self.cout, self.width
        if self.kind == "vgg_conv":
            return 9 * c * o + o
        if self.kind == "vgg_fc":
            return self.fc_inputs * o + o
        if self.kind == "stem":
            return 49 * c * o + 2 * o                    # conv (no bias) + BN scale and shift
        if self.kind == "bottleneck":
            convs = c * w + 9 * w * w + w * o + (c * o if self.downsample else 0)
            norms = 2 * (w + w + o + (o if self.downsample else 0))
            return convs + norms
        if self.kind == "head":
            return c * o + o
        raise ValueError(f"unknown vision layer kind {self.kind!r}")

    @property
    def fc_inputs(self) -> int:
        return self.cin * self.pool_to * self.pool_to if self.pool_to else self.cin

    @property
    def conv_hw(self) -> int:
        """Side of the convolution's output, before any pooling."""
        if self.kind == "vgg_conv":
            return self.in_hw
        if self.kind == "stem":
            return conv_out(self.in_hw, 7, 2, 3)
        return self.out_hw

    @property
    def forward_flops(self) -> float:
        """2 per multiply-add of the convolutions and Linear layers (norms, ReLUs, pools left out)."""
        c, o, w = self.cin, self.cout, self.width
        if self.kind == "vgg_conv":
            return 2.0 * 9 * c * o * self.in_hw ** 2
        if self.kind == "stem":
            return 2.0 * 49 * c * o * self.conv_hw ** 2
        if self.kind == "bottleneck":
            macs = c * w * self.in_hw ** 2 + 9 * w * w * self.out_hw ** 2 + w * o * self.out_hw ** 2
            return 2.0 * (macs + (c * o * self.out_hw ** 2 if self.downsample else 0))
        return 2.0 * (self.fc_inputs if self.kind == "vgg_fc" else c) * o

    @property
    def input_elements(self) -> int:
        return self.cin * self.in_hw ** 2

    @property
    def output_elements(self) -> int:
        return self.cout * self.out_hw ** 2

    @property
    def inner_elements(self) -> int:
        """Values the layer computes besides its output (what autograd keeps for the backward)."""
        if self.kind in ("vgg_conv", "stem"):
            return 2 * self.cout * self.conv_hw ** 2      # convolution output and its ReLU
        if self.kind == "bottleneck":
            branch = 3 * (self.width * self.in_hw ** 2 + self.width * self.out_hw ** 2) + 2 * self.output_elements
            return branch + (2 * self.output_elements if self.downsample else 0)
        return 2 * self.output_elements


def vgg16_layers(image_size: int = 224, num_classes: int = 1000, width_multiplier: float = 1.0) -> list[VisionLayer]:
    layers: list[VisionLayer] = []
    cin, hw = IMAGE_CHANNELS, image_size
    for index, entry in enumerate(VGG16_CONVS):
        if entry == "M":
            continue
        cout = scaled(int(entry), width_multiplier)
        pool = index + 1 < len(VGG16_CONVS) and VGG16_CONVS[index + 1] == "M"
        out_hw = hw // 2 if pool else hw
        layers.append(VisionLayer(f"conv{len(layers) + 1}", "vgg_conv", cin, cout, hw, out_hw, pool=pool))
        cin, hw = cout, out_hw
    hidden = scaled(VGG_HIDDEN, width_multiplier)
    layers.append(VisionLayer("fc1", "vgg_fc", cin, hidden, hw, pool_to=VGG_POOLED_SIZE))
    layers.append(VisionLayer("fc2", "vgg_fc", hidden, hidden))
    layers.append(VisionLayer("fc3", "vgg_fc", hidden, num_classes, activation=False))
    return layers


def resnet50_layers(image_size: int = 224, num_classes: int = 1000, width_multiplier: float = 1.0) -> list[VisionLayer]:
    stem_out = scaled(RESNET_STEM, width_multiplier)
    conv_hw = conv_out(image_size, 7, 2, 3)
    hw = conv_out(conv_hw, 3, 2, 1)
    layers = [VisionLayer("stem", "stem", IMAGE_CHANNELS, stem_out, image_size, hw)]
    cin = stem_out
    for stage, (base_width, blocks) in enumerate(RESNET50_STAGES):
        width = scaled(base_width, width_multiplier)
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            out_hw = conv_out(hw, 3, stride, 1)
            layers.append(VisionLayer(f"bottleneck{stage + 1}.{block}", "bottleneck", cin, EXPANSION * width, hw,
                                      out_hw, width=width, stride=stride, downsample=block == 0))
            cin, hw = EXPANSION * width, out_hw
    layers.append(VisionLayer("fc", "head", cin, num_classes, hw))
    return layers


LAYER_LISTS = {"vgg16": vgg16_layers, "resnet50": resnet50_layers}


def vision_layers(model_cfg: Mapping[str, Any]) -> list[VisionLayer]:
    """The layer list of a ``conf/model`` vision config (name vgg16 or resnet50)."""
    build = LAYER_LISTS.get(str(model_cfg["name"]))
    if build is None:
        raise ValueError(f"model.name={model_cfg['name']!r} is not a vision model; known: {list(LAYER_LISTS)}")
    return build(int(model_cfg["image_size"]), int(model_cfg["num_classes"]), float(model_cfg["width_multiplier"]))


def fewest_normalised_values(model_cfg: Mapping[str, Any], micro_batch: int) -> int | None:
    """Values per channel in the smallest BatchNorm of a training forward over ``micro_batch``
    images (None without BatchNorm): under 2, torch refuses to normalise."""
    sides = [layer.out_hw for layer in vision_layers(model_cfg) if layer.kind in ("stem", "bottleneck")]
    return micro_batch * min(sides) ** 2 if sides else None


def vision_parameters(model_cfg: Mapping[str, Any]) -> int:
    return sum(layer.parameters for layer in vision_layers(model_cfg))


def vision_forward_flops_per_sample(model_cfg: Mapping[str, Any]) -> float:
    return sum(layer.forward_flops for layer in vision_layers(model_cfg))


def vision_layer_count(model_cfg: Mapping[str, Any]) -> int:
    return len(vision_layers(model_cfg))


def vision_flops_per_iteration(model_cfg: Mapping[str, Any], batch: int, recompute: bool,
                               seq_len: int | None = None) -> float:
    """The forward, a backward of twice its FLOPs and, with recomputation, the forward again
    (``seq_len`` does not apply: a sample is one image)."""
    return (4 if recompute else 3) * batch * vision_forward_flops_per_sample(model_cfg)


def check_vision_config(model_cfg: Mapping[str, Any], micro_batch: Any) -> None:
    """A positive width, images that survive five halvings, and (ResNet) micro-batches whose
    smallest BatchNorm sees at least 2 values per channel."""
    width = model_cfg.get("width_multiplier")
    if isinstance(width, bool) or not isinstance(width, (int, float)) or width <= 0:
        raise ConfigError(f"model.width_multiplier = {width!r} must be a positive number (1.0: torchvision's widths)")
    if model_cfg["image_size"] < 32:   # both halve the image five times
        raise ConfigError(f"model.image_size = {model_cfg['image_size']} is too small for {model_cfg['name']}, which "
                          f"halves it five times: use at least 32")
    if isinstance(micro_batch, int) and (fewest_normalised_values(model_cfg, micro_batch) or 2) < 2:
        raise ConfigError(f"train.micro_batch_size = {micro_batch} gives BatchNorm one value per channel in "
                          f"{model_cfg['name']}'s last blocks (1 x 1 pixels): use micro-batches of at least 2 images "
                          f"or a larger model.image_size")
