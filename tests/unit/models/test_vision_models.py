"""VGG-16 and ResNet-50: torchvision's parameter counts, one definition for trainer and planner,
stages that build only their own layers with the single-process weights, and image data."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from models import build_model
from models.facts import flops_per_iteration, parameter_count, pipeline_layer_count
from pipedream.data.datasets import build_datasets
from pipedream.data.batching import collate
from pipedream.errors import ConfigError
from planner.inputs.model_specs import spec_from_config

CONF = Path(__file__).resolve().parents[3] / "conf"
PRESETS = ("vgg16", "resnet50", "vgg16_small", "resnet50_small")
TORCHVISION_PARAMETERS = {"vgg16": 138_357_544, "resnet50": 25_557_032}   # torchvision.models, 1000 classes


def model_cfg(name: str, **over) -> dict:
    return {**yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text()), **over}


def data_cfg(name: str, **over) -> dict:
    return {**yaml.safe_load((CONF / "data" / f"{name}.yaml").read_text()), **over}


@pytest.mark.parametrize("name", TORCHVISION_PARAMETERS)
def test_full_size_models_have_torchvisions_parameter_counts(name):
    with torch.device("meta"):   # shapes only: no memory, no initialisation time
        network = build_model(model_cfg(name)).build_sequential()
    assert sum(p.numel() for p in network.parameters()) == TORCHVISION_PARAMETERS[name]


@pytest.mark.parametrize("name", PRESETS)
def test_planner_and_trainer_count_the_same_model(name):
    cfg = model_cfg(name)
    model = build_model(cfg)
    with torch.device("meta"):
        built = sum(p.numel() for p in model.build_sequential().parameters())
        per_layer = model.build()
    spec = spec_from_config(cfg)
    assert spec.num_parameters() == parameter_count(cfg) == built
    assert len(spec.layer_specs(1)) == pipeline_layer_count(cfg) == model.num_layers == {"vgg": 16, "res": 18}[name[:3]]
    assert [layer.parameters for layer in spec.layer_specs(1)] == [
        sum(p.numel() for p in per_layer[i].parameters()) for i in range(model.num_layers)]
    assert spec.flops_per_sample(False) * 8 == flops_per_iteration(cfg, 8, False)


def test_full_size_flops_are_the_published_ones():
    """VGG-16: 15.5 GMACs, ResNet-50: 4.1 GMACs per 224 x 224 image (convolutions and Linear layers)."""
    assert flops_per_iteration(model_cfg("vgg16"), 1, False) / 3 == pytest.approx(2 * 15.47e9, rel=1e-3)
    assert flops_per_iteration(model_cfg("resnet50"), 1, False) / 3 == pytest.approx(2 * 4.09e9, rel=1e-3)


@pytest.mark.parametrize("name", ["vgg16_small", "resnet50_small"])
def test_a_stage_builds_its_layers_with_the_single_process_weights(name):
    model = build_model(model_cfg(name), seed=7)
    whole = model.build_sequential()
    second_half = model.build(list(range(9, model.num_layers)))
    for i, layer in second_half.items():
        for (key, mine), (_, reference) in zip(layer.state_dict().items(), whole[i].state_dict().items()):
            assert torch.equal(mine, reference), f"layer {i} {key}"
    other_seed = build_model(model_cfg(name), seed=8).build([0])[0]
    assert not torch.equal(whole[0][0].weight, other_seed[0].weight)   # the seed matters


@pytest.mark.parametrize("name", ["vgg16_small", "resnet50_small"])
def test_small_presets_classify_images(name):
    model = build_model(model_cfg(name))
    images, labels = model.make_batch(3, torch.Generator().manual_seed(0))
    assert images.shape == (3, 3, 32, 32)
    logits = model.build_sequential()(images)
    assert logits.shape == (3, 10) and model.loss_fn(logits, labels).ndim == 0


def test_synthetic_images_are_deterministic_and_learnable_patterns():
    cfg = model_cfg("resnet50_small")
    train, val = build_datasets(cfg, data_cfg("synthetic_images"), seed=3)
    again, _ = build_datasets(cfg, data_cfg("synthetic_images"), seed=3)
    assert len(train) + len(val) == 1024 and len(val) == 102
    image, label = train[5]
    assert image.shape == (3, 32, 32) and 0 <= int(label) < 10
    assert torch.equal(image, again[5][0]) and int(label) == int(again[5][1])
    # two images of one class are closer than the noise alone would make them
    same = [i for i in range(200) if int(train[i][1]) == int(label) and i != 5][0]
    other = [i for i in range(200) if int(train[i][1]) != int(label)][0]
    assert (train[same][0] - image).norm() < (train[other][0] - image).norm()


def write_image_folder(root: Path, classes: dict[str, int], size: int = 12) -> None:
    rng = np.random.default_rng(0)
    for name, count in classes.items():
        (root / name).mkdir(parents=True)
        for k in range(count):
            pixels = rng.integers(0, 256, (size, size + k, 3), dtype=np.uint8)
            suffix = ".png" if k % 2 else ".JPG"
            Image.fromarray(pixels).save(root / name / f"img{k}{suffix}")
        (root / name / "notes.txt").write_text("not an image")


def test_image_folder_decodes_png_and_jpeg(tmp_path):
    write_image_folder(tmp_path, {"cat": 5, "dog": 5})
    train, val = build_datasets(model_cfg("vgg16_small"), data_cfg("image_folder", path=str(tmp_path),
                                                                   val_fraction=0.2), seed=1)
    assert len(train) == 8 and len(val) == 2
    inputs, targets = collate(train, list(range(len(train))))
    assert inputs.shape == (8, 3, 32, 32) and inputs.dtype == torch.float32
    assert targets.tolist() == [{"cat": 0, "dog": 1}[path.parent.name] for path, _ in train.samples]
    assert not {path for path, _ in train.samples} & {path for path, _ in val.samples}
    # a PNG decodes to its pixels, resized and normalised with ImageNet's statistics
    png = tmp_path / "cat" / "img1.png"
    dataset = train if png in [path for path, _ in train.samples] else val
    sample = dataset[[path for path, _ in dataset.samples].index(png)][0]
    expected = np.asarray(Image.open(png).convert("RGB").resize((32, 32), Image.Resampling.BILINEAR), np.float32) / 255
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    np.testing.assert_allclose(sample.permute(1, 2, 0).numpy(), (expected - mean) / std, rtol=1e-5, atol=1e-5)


def test_image_folder_uses_train_and_val_subfolders(tmp_path):
    write_image_folder(tmp_path / "train", {"a": 3, "b": 2, "c": 1})
    write_image_folder(tmp_path / "val", {"a": 1, "b": 1, "c": 1})
    train, val = build_datasets(model_cfg("resnet50_small"), data_cfg("image_folder", path=str(tmp_path)), seed=1)
    assert len(train) == 6 and len(val) == 3
    assert [int(val[i][1]) for i in range(3)] == [0, 1, 2]


@pytest.mark.parametrize("classes,over,message", [
    ({}, {}, "has no class sub-folders"),
    ({"a": 0}, {}, "holds no .png/.jpg/.jpeg images"),
    ({"a": 1, "b": 1, "c": 1}, {"num_classes": 2}, "has 3 classes but model.num_classes=2"),
])
def test_image_folder_refuses_what_it_cannot_use(tmp_path, classes, over, message):
    write_image_folder(tmp_path, classes)
    with pytest.raises(ConfigError, match=message) as err:
        build_datasets(model_cfg("vgg16_small", **over), data_cfg("image_folder", path=str(tmp_path)), seed=1)
    assert "\n" not in str(err.value)


def test_vision_models_refuse_text_data():
    with pytest.raises(ConfigError, match="model=vgg16 trains on images, not data=pydoc"):
        build_datasets(model_cfg("vgg16_small"), data_cfg("pydoc"), seed=1)
