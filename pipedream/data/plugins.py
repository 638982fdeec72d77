"""Plugin datasets (``data._target_``): built through ``models.plugins``' checked call and checked
before any process group exists; each failure is one ``ConfigError`` line."""
from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from models.errors import ConfigError
from models.plugin_config import TARGET, plugin_target
from models.plugins import CHECK_BATCH, call_target, describe, is_boundary, meta_forward_flops, type_names
from models.spec import LayerModel
from pipedream.data.batching import collate


def plugin_datasets(data_cfg: Any, seed: int) -> tuple[Dataset, Dataset]:
    """(train, validation) from a data plugin, checked: two non-empty Datasets whose samples are
    (input, target) pairs of tensors or tuples of tensors."""
    label = f"data.{TARGET}={plugin_target(data_cfg)}"
    result = call_target(data_cfg, "data", seed)
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and all(isinstance(d, Dataset) for d in result)):
        raise ConfigError(f"{label} returned {type_names(result)}, not (train, validation) "
                          f"torch.utils.data.Dataset objects: return a pair of datasets")
    for name, dataset in zip(("train", "validation"), result):
        if len(dataset) == 0:
            raise ConfigError(f"{label}: the {name} set is empty: give it at least one global batch of samples")
        sample = dataset[0]
        if not (isinstance(sample, (tuple, list)) and len(sample) == 2
                and all(is_boundary(tuple(m) if isinstance(m, list) else m) for m in sample)):
            raise ConfigError(f"{label}: {name} samples are {describe(sample)}, not (input, target) pairs of "
                              f"tensors or tuples of tensors")
    return result[0], result[1]


def check_data_fits(model_cfg: Any, model: LayerModel, data_cfg: Any, train_set: Dataset) -> None:
    """A batch of the data plugin's first samples runs through the model and its loss (meta device)."""
    batch = collate(train_set, list(range(min(CHECK_BATCH, len(train_set)))))
    meta_forward_flops(model, f"data.{TARGET}={plugin_target(data_cfg)}", batch,
                        problem=f"its batches do not fit model.{TARGET}={plugin_target(model_cfg)}")
