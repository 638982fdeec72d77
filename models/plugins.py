"""Plugin models (and the calls behind plugin datasets, ``pipedream.data.plugins``) (``model._target_`` / ``data._target_``, see ``plugin_config``):
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
from torch.utils._python_dispatch import TorchDispatchMode

from models import boundary
from models.contract import layer_type_name
from models.spec import LayerModel
from models.errors import ConfigError
from models.plugin_config import TARGET, plugin_target

CHECK_BATCH = 2   # samples of the example batch the layers are checked with (on the meta device)


@dataclass(frozen=True)
class CheckedModel:
    model: LayerModel
    forward_flops_per_sample: float   # counted on the meta device (torch.utils.flop_counter)
    # per layer, for CHECK_BATCH samples: (forward FLOPs, operators dispatched)
    layer_counts: tuple[tuple[float, int], ...] = ()
    attention_cores: int = 0          # models.CoreAttention modules in the layers (selective recomputation)


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


def call_target(section: Any, kind: str, seed: int) -> Any:
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
    model = call_target(model_cfg, "model", seed)
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
    layers, per_layer = _run_on_meta(model, label, None, "layers do not chain")
    return CheckedModel(model, sum(flops for flops, _ in per_layer) / CHECK_BATCH, tuple(per_layer),
                        _attention_core_count(layers))


def meta_forward_flops(model: LayerModel, label: str, batch: tuple[Any, Any] | None = None,
                        problem: str = "layers do not chain") -> float:
    """Runs ``batch`` (default: the model's example batch) through the layers and the loss on the
    meta device; returns the forward FLOPs."""
    return sum(flops for flops, _ in meta_layer_counts(model, label, batch, problem))


class _OperatorCounter(TorchDispatchMode):
    """Counts the operators dispatched under it (each costs a fixed time on a real device)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def meta_layer_counts(model: LayerModel, label: str, batch: tuple[Any, Any] | None = None,
                      problem: str = "layers do not chain") -> list[tuple[float, int]]:
    """As ``meta_forward_flops``, per layer: (forward FLOPs, operators dispatched); the loss's
    count goes to the last layer."""
    return _run_on_meta(model, label, batch, problem)[1]


def _run_on_meta(model: LayerModel, label: str, batch: tuple[Any, Any] | None,
                 problem: str) -> tuple[Any, list[tuple[float, int]]]:
    """The layers built on the meta device, and ``meta_layer_counts`` of running them."""
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
    per_layer: list[tuple[float, int]] = []
    with (FlopCounterMode(display=False) as counter, _OperatorCounter() as operators, torch.no_grad(),
          warnings.catch_warnings()):
        warnings.simplefilter("ignore")
        for index in range(model.num_layers):
            layer = layers[index]
            counted, dispatched = counter.get_total_flops(), operators.count
            try:
                value = boundary.call_layer(layer, value)
            except Exception as error:  # noqa: BLE001
                raise ConfigError(f"{label}: {problem}: layer {index} ({layer_type_name(layer)}) fails on "
                                  f"{describe(value)} ({_first_line(error)}): make layer {index} accept what "
                                  f"{'the batch input' if index == 0 else f'layer {index - 1}'} gives") from None
            if not is_boundary(value):
                raise ConfigError(f"{label}: layer {index} ({layer_type_name(layer)}) returned {describe(value)}: a "
                                  f"layer returns a tensor or a tuple of tensors")
            per_layer.append((float(counter.get_total_flops() - counted), operators.count - dispatched))
        counted, dispatched = counter.get_total_flops(), operators.count
        try:
            loss = model.loss_fn(value, target)
        except Exception as error:  # noqa: BLE001
            context = f"{problem}: " if batch is not None else ""
            raise ConfigError(f"{label}: {context}the loss fails on output {describe(value)} and target "
                              f"{describe(target)} ({_first_line(error)}): make loss_fn accept them") from None
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
        raise ConfigError(f"{label}: the loss returned {describe(loss)}, not a scalar floating-point tensor: "
                          f"reduce it (e.g. .mean()) in loss_fn")
    flops, ops = per_layer[-1]
    per_layer[-1] = (flops + float(counter.get_total_flops() - counted), ops + operators.count - dispatched)
    return layers, per_layer


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="meta")
    if isinstance(value, (tuple, list)):
        return tuple(_to_meta(member) for member in value)
    raise TypeError(f"make_batch gave a {type(value).__name__}: batches hold tensors or tuples of tensors")


def is_boundary(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or (
        isinstance(value, tuple) and len(value) > 0 and all(isinstance(t, torch.Tensor) for t in value))


def type_names(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(type(member).__name__ for member in value) + ")"
    return type(value).__name__


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    if isinstance(value, tuple) and all(isinstance(t, torch.Tensor) for t in value):
        return "(" + ", ".join(describe(t) for t in value) + ")"
    return f"a {type(value).__name__}"


def _attention_core_count(layers: Any) -> int:
    """How many ``models.CoreAttention`` modules the built layers hold."""
    from models.attention import CoreAttention
    return sum(isinstance(m, CoreAttention) for layer in layers.values() for m in layer.modules())
