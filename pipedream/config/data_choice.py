"""The data section of a run, checked against its model before any process starts: a built-in
corpus or image set that exists, a plugin's datasets that fit the plugin model, a sequence length
within the model's context."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.family import IMAGES, TEACHER_REGRESSION
from models.plugin_config import plugin_target
from models.registry import model_family

from pipedream.config.specs import config_value
from pipedream.errors import ConfigError

if TYPE_CHECKING:
    from models.plugins import CheckedModel

DATASETS = ("pydoc", "text_file", "token_bin", "synthetic")
VISION_DATASETS = ("synthetic_images", "image_folder")   # for model=vgg16 / resnet50


def check_data_section(cfg: Any, plugin: CheckedModel | None) -> int | None:
    """Checks the data section against the model (a plugin's data built and checked against
    ``plugin``); returns the tokens per sample, None where samples are not sequences."""
    model_plugin = plugin_target(cfg.model)
    if plugin_target(cfg.data) is not None:
        from pipedream.data.plugins import check_data_fits, plugin_datasets
        train_set, _ = plugin_datasets(cfg.data, 0)   # imports, builds and checks the plugin
        if plugin is not None:
            check_data_fits(cfg.model, plugin.model, cfg.data, train_set)
        return None if model_plugin or not model_family(cfg.model.name).sequence else int(cfg.model.seq_len)
    if model_plugin is not None:
        raise ConfigError(f"model._target_={model_plugin} needs its data as a plugin too: give "
                          f"data._target_=my_pkg.my_module.build_datasets (docs/models.md)")
    data_kind = model_family(cfg.model.name).data_kind
    if data_kind == IMAGES:
        return _check_image_data(cfg)
    name = config_value(cfg, "data.name")
    if name not in DATASETS:
        raise ConfigError(f"data={name!r} is unknown: choose one of {', '.join(DATASETS)}")
    if name in ("text_file", "token_bin"):
        path = config_value(cfg, "data.path")
        if path in (None, "", "???"):
            raise ConfigError(f"data={name} needs data.path=/path/to/data")
        if not Path(str(path)).expanduser().exists():
            raise ConfigError(f"data.path={str(path)!r} does not exist: give an existing file or folder")
    if data_kind == TEACHER_REGRESSION:
        if name != "synthetic":
            raise ConfigError(f"model={cfg.model.name} trains on synthetic regression data, not data={name}: "
                              f"use data=synthetic")
        return None
    seq_len = config_value(cfg, "data.seq_len") or cfg.model.seq_len
    if seq_len > cfg.model.seq_len:
        raise ConfigError(f"data.seq_len={seq_len} exceeds the model's context model.seq_len={cfg.model.seq_len}: "
                          f"lower data.seq_len or raise model.seq_len")
    return int(seq_len)


def _check_image_data(cfg: Any) -> None:
    name = config_value(cfg, "data.name")
    if name not in VISION_DATASETS:
        raise ConfigError(f"model={cfg.model.get('preset') or cfg.model.name} trains on images, not data={name}: "
                          f"use data=synthetic_images or data=image_folder data.path=/path/to/class/folders")
    if name == "image_folder":
        path = config_value(cfg, "data.path")
        if path in (None, "", "???"):
            raise ConfigError("data=image_folder needs data.path=/path/to/class/folders")
        if not Path(str(path)).expanduser().is_dir():
            raise ConfigError(f"data.path={str(path)!r} is not a folder: give a folder of class sub-folders of images")
    return None
