"""Builds the model contract (``LayerModel``) from modules a user already has: an ``nn.Sequential``
or a list of modules, a loss and one example batch (docs/models.md). The modules keep
``nn.Sequential``'s calling convention: what one returns, a tuple included, is the next one's one
argument (``SequentialCall``)."""
from __future__ import annotations

import copy
from typing import Any, Callable, Iterable

import torch
from torch import nn

from models.spec import LayerModel, PipelineSequential


CONTAINERS = (nn.Sequential, PipelineSequential)


def pipeline_layers(modules: nn.Module | Iterable[nn.Module], unpacks: bool = False) -> list[nn.Module]:
    """The pipeline layers of ``modules``: nested plain ``nn.Sequential`` containers are flattened,
    any other module (a subclass with its own ``forward`` included) is one layer, called as its
    container calls it: wrapped in ``SequentialCall``, unless the container is a
    ``PipelineSequential`` (``unpacks``), which unpacks tuples as the runtime does."""
    if isinstance(modules, nn.Module) and type(modules) not in CONTAINERS:
        return [modules if unpacks else SequentialCall(modules)]
    layers: list[nn.Module] = []
    for module in modules:
        if not isinstance(module, nn.Module):
            raise TypeError(f"{type(module).__name__} is not a torch.nn.Module: a pipeline layer is a module")
        layers.extend(pipeline_layers(module, type(modules) is PipelineSequential))
    return layers


class SequentialCall(nn.Module):
    """One module of a model given to ``from_modules``, called as ``nn.Sequential`` calls it. The
    runtime unpacks a tuple into a layer's arguments (``LayerModel``'s convention, for layers written
    as ``forward(self, hidden, mask)``); this packs them back, so the module receives the tuple as
    its one argument, as in plain PyTorch. Its parameters are named ``module.<name>``."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *inputs: Any) -> Any:
        return self.module(inputs[0] if len(inputs) == 1 else inputs)


def layer_type_name(layer: nn.Module) -> str:
    """The class name of the user's module, through ``SequentialCall``."""
    return type(layer.module if isinstance(layer, SequentialCall) else layer).__name__


def shared_parameters(layers: list[nn.Module]) -> tuple[tuple[tuple[int, str], ...], ...]:
    """Groups of (layer, parameter name) that are one Parameter in different layers (e.g. a tied
    embedding and output head): ``LayerModel.tied``."""
    holders: dict[int, list[tuple[int, str]]] = {}
    for index, layer in enumerate(layers):
        for name, param in layer.named_parameters(remove_duplicate=True):
            holders.setdefault(id(param), []).append((index, name))
    return tuple(tuple(group) for group in holders.values() if len(group) > 1)


def _fresh_copy(module: nn.Module) -> nn.Module:
    """An independent copy with the same values; under ``with torch.device("meta")`` (shape
    inference) a copy on the meta device, without copying any data."""
    if torch.get_default_device().type != "meta":
        return copy.deepcopy(module)
    return meta_copy(module)


def meta_copy(module: nn.Module) -> nn.Module:
    """The module's structure with meta parameters and buffers (no data copied)."""
    memo: dict[int, Any] = {}
    for param in module.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    for buffer in module.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(module, memo)


def random_like(example: Any, batch_size: int, generator: torch.Generator) -> Any:
    """A random batch of ``batch_size`` samples shaped like ``example`` (a tensor or a tuple of
    them): normal floats, integers within the example's range, random booleans."""
    if isinstance(example, (tuple, list)):
        return tuple(random_like(member, batch_size, generator) for member in example)
    if not isinstance(example, torch.Tensor):
        raise TypeError(f"an example batch holds tensors or tuples of tensors, not {type(example).__name__}")
    shape = (batch_size, *example.shape[1:])
    if example.dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if example.is_floating_point():
        return torch.randn(shape, generator=generator, dtype=example.dtype)
    low, high = (int(example.min()), int(example.max()) + 1) if example.numel() else (0, 1)
    return torch.randint(low, high, shape, generator=generator, dtype=example.dtype)


def from_modules(modules: nn.Module | Iterable[nn.Module], loss_fn: Callable[[Any, Any], torch.Tensor],
                 example_batch: tuple[Any, Any], name: str = "model") -> LayerModel:
    """The contract for ``modules`` (an ``nn.Sequential``, possibly nested, or a list of modules).

    Every process builds the whole model once and keeps copies of the layers it owns, so build
    ``modules`` deterministically (the trainer seeds torch's RNG with ``train.seed`` around a
    plugin's build). A Parameter shared by several layers becomes a tied group. ``example_batch``
    is one (input, target) pair of batched tensors (or tuples of them): random batches for shape
    inference and profiling follow its shapes, dtypes and integer ranges. Each module is called as
    ``modules`` would call it (``SequentialCall``): a tuple passed on is one argument.
    """
    layers = pipeline_layers(modules)
    if not layers:
        raise ValueError("from_modules got no layers: pass an nn.Sequential or a non-empty list of modules")
    example_input, example_target = example_batch

    def make_batch(batch_size: int, generator: torch.Generator) -> tuple[Any, Any]:
        return random_like(example_input, batch_size, generator), random_like(example_target, batch_size, generator)

    return LayerModel(name=name, num_layers=len(layers), build_layer=lambda i: _fresh_copy(layers[i]),
                      loss_fn=loss_fn, make_batch=make_batch, tied=shared_parameters(layers))
