"""Image data for ``model=vgg16`` / ``model=resnet50``: generated class patterns
(``data=synthetic_images``) or a folder of class sub-folders of PNG/JPEG files
(``data=image_folder``, decoded with Pillow). Samples are (3 x S x S float image, class id)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pipedream.errors import ConfigError, DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
IMAGENET_MEAN = (0.485, 0.456, 0.406)   # the channel statistics torchvision's ImageNet models expect
IMAGENET_STD = (0.229, 0.224, 0.225)
PATTERN_SIDE = 8   # class patterns are drawn at 8 x 8 and upsampled: memory stays small at 224 x 224


class SyntheticImages(torch.utils.data.Dataset):
    """Image ``index``: its class's fixed random pattern (upsampled to ``image_size``) plus
    Gaussian noise; class and noise depend only on (seed, index), so every rank agrees."""

    def __init__(self, num_samples: int, image_size: int, num_classes: int, noise: float, seed: int, stream: int):
        patterns = np.random.default_rng([seed, 0x494D47]).standard_normal((num_classes, 3, PATTERN_SIDE, PATTERN_SIDE))
        self.patterns = F.interpolate(torch.from_numpy(patterns.astype(np.float32)), size=image_size,
                                      mode="bilinear", align_corners=False)
        self.count, self.noise, self.seed, self.stream = num_samples, noise, seed, stream

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.stream, index])
        label = int(rng.integers(len(self.patterns)))
        noise = torch.from_numpy(rng.standard_normal(self.patterns.shape[1:], dtype=np.float32))
        return self.patterns[label] + self.noise * noise, torch.tensor(label)


def image_files(root: Path) -> tuple[list[str], list[tuple[Path, int]]]:
    """(class names, [(file, class id)]) of ``root``/<class>/<image>, sorted by name."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not classes:
        raise ConfigError(f"data.path={str(root)!r} has no class sub-folders: data=image_folder reads "
                          f"<path>/<class>/<image>.png|jpg")
    samples = [(file, label) for label, name in enumerate(classes)
               for file in sorted((root / name).rglob("*")) if file.suffix.lower() in IMAGE_SUFFIXES]
    if not samples:
        raise ConfigError(f"data.path={str(root)!r} holds no .png/.jpg/.jpeg images in its class sub-folders "
                          f"({', '.join(classes[:3])}): add images or point data.path elsewhere")
    return classes, samples


class ImageFiles(torch.utils.data.Dataset):
    """Decodes one file per sample with Pillow: RGB, resized to ``image_size`` x ``image_size``
    (bilinear), scaled to [0, 1] and normalised with ImageNet's channel statistics."""

    def __init__(self, samples: list[tuple[Path, int]], image_size: int):
        self.samples, self.image_size = samples, image_size
        self.mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image, UnidentifiedImageError

        path, label = self.samples[index]
        try:
            with Image.open(path) as image:
                rgb = image.convert("RGB").resize((self.image_size, self.image_size), Image.Resampling.BILINEAR)
        except (OSError, UnidentifiedImageError) as err:
            raise DataError(f"image {path} cannot be decoded ({err}): remove or replace the file") from None
        pixels = torch.from_numpy(np.asarray(rgb, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return (pixels - self.mean) / self.std, torch.tensor(label)


def image_folder_datasets(data_cfg: Any, image_size: int, num_classes: int, seed: int
                          ) -> tuple[ImageFiles, ImageFiles]:
    root = Path(str(data_cfg["path"])).expanduser()
    if not root.is_dir():
        raise ConfigError(f"data.path={str(root)!r} is not a folder: data=image_folder needs a folder of "
                          f"class sub-folders of images")
    if (root / "train").is_dir() and (root / "val").is_dir():
        train_classes, train = image_files(root / "train")
        val_classes, val = image_files(root / "val")
        if val_classes != train_classes:
            raise ConfigError(f"data.path={str(root)!r}: train/ and val/ hold different class folders "
                              f"({len(train_classes)} and {len(val_classes)}): give both the same classes")
        classes = train_classes
    else:
        classes, samples = image_files(root)
        order = np.random.default_rng([seed, 0x5354]).permutation(len(samples))
        held_out = int(len(samples) * float(data_cfg["val_fraction"]))
        train = [samples[i] for i in sorted(order[held_out:])]
        val = [samples[i] for i in sorted(order[:held_out])]
    if len(classes) > num_classes:
        raise ConfigError(f"data.path={str(root)!r} has {len(classes)} classes but model.num_classes={num_classes}: "
                          f"set model.num_classes={len(classes)}")
    return ImageFiles(train, image_size), ImageFiles(val, image_size)


def vision_datasets(model_cfg: Any, data_cfg: Any, seed: int) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
    """(train, validation) image datasets for a vision model."""
    name, size, classes = data_cfg["name"], int(model_cfg["image_size"]), int(model_cfg["num_classes"])
    if name == "image_folder":
        return image_folder_datasets(data_cfg, size, classes, seed)
    if name != "synthetic_images":
        raise ConfigError(f"model={model_cfg['name']} trains on images, not data={name}: use data=synthetic_images "
                          f"or data=image_folder data.path=/path/to/class/folders")
    total, noise = int(data_cfg["num_samples"]), float(data_cfg["noise"])
    held_out = int(total * float(data_cfg["val_fraction"]))
    return (SyntheticImages(total - held_out, size, classes, noise, seed, 0),
            SyntheticImages(held_out, size, classes, noise, seed, 1))
