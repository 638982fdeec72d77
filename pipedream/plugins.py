"""Plugin models and datasets (``model._target_`` / ``data._target_``, see ``plugin_config``):
called through Hydra's ``instantiate`` with the section's other keys as keyword arguments, under
torch's RNG seeded with the run's seed (so every process builds the same weights and data), and
checked before any process group exists. Each failure is one ``ConfigError`` line that names the
target and what was wrong."""
from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.utils.data import Dataset

from models.spec import LayerModel

from . import boundary
from .errors import ConfigError
from .plugin_config import TARGET, plugin_target

CHECK_BATCH = 2   # samples of the example batch the layers are checked with (on the meta device)


@dataclass(frozen=True)
class CheckedModel:
    model: LayerModel
    forward_flops_per_sample: float   # counted on the meta device (torch.utils.flop_counter)


def _first_line(error: BaseException) -> str:
    cause = error.__cause__ or error
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0] if lines else ''}".rstrip(": ")


@contextmanager
def _hydra_utils_quiet() -> Iterator[None]:
    """``get_method`` logs its failure on several lines before raising; the one line is ours."""
    logger = logging.getLogger("hydra.utils")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _call_target(section: Any, kind: str, seed: int) -> Any:
    """Imports and calls the section's ``_target_`` (Hydra's get_method and instantiate)."""
    from hydra.utils import get_method, instantiate

    target = plugin_target(section)
    label = f"{kind}.{TARGET}={target}"
    try:
        with _hydra_utils_quiet():
            get_method(target)
    except Exception as error:  # noqa: BLE001 - Hydra raises ImportError or ValueError, with the cause chained
        raise ConfigError(f"{label} cannot be imported ({_first_line(error)}): give an importable callable as "
                          f"package.module.function, on PYTHONPATH or pip-installed") from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return instantiate(section, _convert_="all")
        except Exception as error:  # noqa: BLE001 - the user's code may raise anything
            raise ConfigError(f"{label} raised {_first_line(error)}: fix the plugin or its {kind}.* "
                              f"arguments") from None


def plugin_model(model_cfg: Any, seed: int) -> LayerModel:
    """The contract a model plugin returns (its type checked, its layers not yet run)."""
    model = _call_target(model_cfg, "model", seed)
    if not isinstance(model, LayerModel):
        raise ConfigError(f"model.{TARGET}={plugin_target(model_cfg)} returned {type(model).__name__}, not a "
                          f"models.LayerModel: return models.from_modules(layers, loss_fn, example_batch) "
                          f"(docs/models.md)")
    return model


def checked_model(model_cfg: Any, seed: int = 0) -> CheckedModel:
    """The plugin model, after running its example batch through every layer and the loss on the
    meta device: the layers must chain and the loss must be a scalar."""
    model = plugin_model(model_cfg, seed)
    label = f"model.{TARGET}={plugin_target(model_cfg)}"
    if not isinstance(model.num_layers, int) or model.num_layers < 1:
        raise ConfigError(f"{label} has num_layers={model.num_layers!r}: a model needs at least one layer")
    return CheckedModel(model, _meta_forward_flops(model, label) / CHECK_BATCH)


def check_data_fits(model_cfg: Any, model: LayerModel, data_cfg: Any, train_set: Dataset) -> None:
    """A batch of the data plugin's first samples runs through the model and its loss (meta device)."""
    from .data import collate

    batch = collate(train_set, list(range(min(CHECK_BATCH, len(train_set)))))
    _meta_forward_flops(model, f"data.{TARGET}={plugin_target(data_cfg)}", batch,
                        problem=f"its batches do not fit model.{TARGET}={plugin_target(model_cfg)}")


def _meta_forward_flops(model: LayerModel, label: str, batch: tuple[Any, Any] | None = None,
                        problem: str = "layers do not chain") -> float:
    """Runs ``batch`` (default: the model's example batch) through the layers and the loss on the
    meta device; returns the forward FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        inputs, target = batch if batch is not None else model.make_batch(CHECK_BATCH, torch.Generator().manual_seed(0))
        with torch.device("meta"):
            layers = model.build()
        value, target = _to_meta(inputs), _to_meta(target)
    except Exception as error:  # noqa: BLE001
        raise ConfigError(f"{label}: building the layers or the example batch failed ({_first_line(error)}): "
                          f"build_layer and make_batch must run under torch.device('meta')") from None
    # warnings.catch_warnings: the check's own runs stay quiet (the training run warns again)
    with FlopCounterMode(display=False) as counter, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for index in range(model.num_layers):
            layer = layers[index]
            try:
                value = boundary.call_layer(layer, value)
            except Exception as error:  # noqa: BLE001
                raise ConfigError(f"{label}: {problem}: layer {index} ({type(layer).__name__}) fails on "
                                  f"{_describe(value)} ({_first_line(error)}): make layer {index} accept what "
                                  f"{'the batch input' if index == 0 else f'layer {index - 1}'} gives") from None
            if not _is_boundary(value):
                raise ConfigError(f"{label}: layer {index} ({type(layer).__name__}) returned {_describe(value)}: a "
                                  f"layer returns a tensor or a tuple of tensors")
        try:
            loss = model.loss_fn(value, target)
        except Exception as error:  # noqa: BLE001
            context = f"{problem}: " if batch is not None else ""
            raise ConfigError(f"{label}: {context}the loss fails on output {_describe(value)} and target "
                              f"{_describe(target)} ({_first_line(error)}): make loss_fn accept them") from None
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
        raise ConfigError(f"{label}: the loss returned {_describe(loss)}, not a scalar floating-point tensor: "
                          f"reduce it (e.g. .mean()) in loss_fn")
    return float(counter.get_total_flops())


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="meta")
    if isinstance(value, (tuple, list)):
        return tuple(_to_meta(member) for member in value)
    raise TypeError(f"make_batch gave a {type(value).__name__}: batches hold tensors or tuples of tensors")


def _is_boundary(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or (
        isinstance(value, tuple) and len(value) > 0 and all(isinstance(t, torch.Tensor) for t in value))


def _type_names(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(type(member).__name__ for member in value) + ")"
    return type(value).__name__


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    if isinstance(value, tuple) and all(isinstance(t, torch.Tensor) for t in value):
        return "(" + ", ".join(_describe(t) for t in value) + ")"
    return f"a {type(value).__name__}"


def plugin_datasets(data_cfg: Any, seed: int) -> tuple[Dataset, Dataset]:
    """(train, validation) from a data plugin, checked: two non-empty Datasets whose samples are
    (input, target) pairs of tensors or tuples of tensors."""
    label = f"data.{TARGET}={plugin_target(data_cfg)}"
    result = _call_target(data_cfg, "data", seed)
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and all(isinstance(d, Dataset) for d in result)):
        raise ConfigError(f"{label} returned {_type_names(result)}, not (train, validation) "
                          f"torch.utils.data.Dataset objects: return a pair of datasets")
    for name, dataset in zip(("train", "validation"), result):
        if len(dataset) == 0:
            raise ConfigError(f"{label}: the {name} set is empty: give it at least one global batch of samples")
        sample = dataset[0]
        if not (isinstance(sample, (tuple, list)) and len(sample) == 2
                and all(_is_boundary(tuple(m) if isinstance(m, list) else m) for m in sample)):
            raise ConfigError(f"{label}: {name} samples are {_describe(sample)}, not (input, target) pairs of "
                              f"tensors or tuples of tensors")
    return result[0], result[1]
